"""Data sampling on 2 gloo ranks: `DistributedDataAnalyzer` writes the files the single-process `DataAnalyzer`
writes (`.bin` byte for byte), and the curriculum sampler gives each data-parallel rank its contiguous half of
every micro batch of DeepSpeed 0.19.8's recorded order (dp rank 0 draws, the batch is broadcast)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from ds_comm.testing import run_ranks

FIXTURES = Path(__file__).parent.parent / "fixtures" / "data_sampling"


def _cases() -> Any:
    if str(FIXTURES) not in sys.path:
        sys.path.insert(0, str(FIXTURES))
    import data_sampling_cases

    return data_sampling_cases


def _analyze_and_sample(rank: int, world: int, root: str) -> list[list[int]]:
    import torch.distributed as dist

    from ds_engine._data.distributed_analyzer import DistributedDataAnalyzer
    from ds_engine._data.sampler import DeepSpeedDataSampler
    from ds_engine.config import DeepSpeedConfig

    cases = _cases()
    kw = cases.analyzer_kwargs(torch)
    kw.pop("metric_dtypes"), kw.pop("num_threads_reduce"), kw.pop("num_workers")
    kw["num_threads"] = 1  # the ranks are daemonic processes (no children); threads are tested in-process
    DistributedDataAnalyzer(
        cases.MetricDataset(), num_workers=world, worker_id=rank, save_path=f"{root}/dist", **kw
    ).run_map_reduce()
    name = "value_fixed_linear"
    case = cases.SAMPLER_CASES[name]
    section = cases.sampler_config(name, case, f"{root}/dist")
    cfg = DeepSpeedConfig(
        {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "data_efficiency": section},
        world_size=world,
    )
    sampler = DeepSpeedDataSampler(
        cfg.data_efficiency_config, cases.NUM_SAMPLES, 2, rank, world, dist.group.WORLD, 2, rank
    )
    return [list(mb) for mb in sampler]


def test_distributed_analyzer_and_sampler_on_two_ranks(tmp_path: Path) -> None:
    from ds_engine._data.analyzer import DataAnalyzer

    cases = _cases()
    results = run_ranks(2, _analyze_and_sample, str(tmp_path), timeout_s=120)
    single = tmp_path / "single"
    kw = cases.analyzer_kwargs(torch, num_workers=1, num_threads=1, num_threads_reduce=1)
    analyzer = DataAnalyzer(cases.MetricDataset(), save_path=str(single), **kw)
    analyzer.run_map()
    analyzer.run_reduce()
    for metric in ("seqlen", "vocab"):
        for kind in ("sample_to_metric", "index_to_metric", "index_to_sample", "index_to_sample_percentile_merged"):
            name = f"{metric}/{metric}_{kind}.bin"
            assert (tmp_path / "dist" / name).read_bytes() == (single / name).read_bytes(), name
    assert (tmp_path / "dist/total/total_metric_value.bin").read_bytes() == (
        single / "total/total_metric_value.bin"
    ).read_bytes()
    recorded = json.loads((FIXTURES / "deepspeed_data_sampling.json").read_text())["sampler"]["value_fixed_linear"]
    assert [a + b for a, b in zip(results[0], results[1], strict=False)] == recorded


class _Mpu:
    """Model parallel of size 1 over the world: every rank is its own model-parallel group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.mp_groups = [dist.new_group([r]) for r in range(self.world)]
        self.dp_group = dist.new_group(list(range(self.world)))

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_group(self) -> Any:
        return self.mp_groups[self.rank]

    def get_data_parallel_rank(self) -> int:
        return self.rank

    def get_data_parallel_world_size(self) -> int:
        return self.world

    def get_data_parallel_group(self) -> Any:
        return self.dp_group


def _single_cluster_training(rank: int, world: int, root: str) -> list[Any]:
    """DeepSpeed's own curriculum test scenario: a single_cluster metric (no index files), bf16, an mpu."""
    import ds_engine

    config = {
        "train_batch_size": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "weight_decay": 0.01, "torch_adam": True}},
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "data_efficiency": {
            "enabled": True,
            "seed": 1234,
            "data_sampling": {
                "enabled": True,
                "num_workers": 0,
                "curriculum_learning": {
                    "enabled": True,
                    "data_cluster_path": root,
                    "curriculum_metrics": {
                        "dummy_metric": {
                            "index_to_sample_path": "dummy",
                            "index_to_metric_path": "dummy",
                            "difficulty_type": "value",
                            "clustering_type": "single_cluster",
                            "min_difficulty": 2,
                            "max_difficulty": 10,
                            "schedule_type": "fixed_root",
                            "schedule_config": {"total_curriculum_step": 8, "difficulty_step": 2, "root_degree": 1},
                        }
                    },
                },
            },
        },
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.ReLU(), torch.nn.Linear(10, 1))
    data = torch.utils.data.TensorDataset(torch.arange(20.0).repeat_interleave(10).reshape(20, 10), torch.zeros(20, 1))
    engine, _, loader, _ = ds_engine.initialize(
        config=config, model=model, model_parameters=model.parameters(), training_data=data, mpu=_Mpu()
    )
    difficulties = []
    engine.set_data_post_process_func(
        lambda batch, state: difficulties.append(state["current_difficulties"]["dummy_metric"]) or batch
    )
    seen = []
    for n, (x, y) in enumerate(loader):
        seen.append(int(x[0, 0].item()))
        loss = torch.nn.functional.mse_loss(engine(x.bfloat16()).float(), y)
        engine.backward(loss)
        engine.step()
        if n >= 10:
            break
    return [seen, difficulties, engine.global_steps]


def test_deepspeeds_single_cluster_scenario_trains_on_two_ranks(tmp_path: Path) -> None:
    (seen0, diff0, steps0), (seen1, diff1, steps1) = run_ranks(
        2, _single_cluster_training, str(tmp_path), timeout_s=120
    )
    # one sample per rank per step, every sample of the dataset once per epoch, the same difficulties on both ranks
    assert steps0 == steps1 == 11 and diff0 == diff1
    assert diff0 == [2, 4, 4, 6, 6, 8, 8, 10, 10, 10, 10]  # floor(2 + 8 * step / 8) down to a multiple of 2
    assert sorted(seen0[:10] + seen1[:10]) == list(range(20))
