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
