"""The engine under `data_efficiency.data_sampling.curriculum_learning`: the training loader is the curriculum
loader (DeepSpeed 0.19.8's batch order, recorded in `fixtures/data_sampling`), the custom schedule and the
post-processing hook reach it, and a checkpoint carries the sampler state under `data_sampler`."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, make_engine, tiny_net

from ds_engine._data.analyzer import DataAnalyzer
from ds_engine._data.loader import CurriculumDataLoader
from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError

FIXTURES = Path(__file__).parent / "fixtures" / "data_sampling"
sys.path.insert(0, str(FIXTURES))
import data_sampling_cases as cases  # noqa: E402

RECORDED = json.loads((FIXTURES / "deepspeed_data_sampling.json").read_text())["sampler"]


class TrainSet(torch.utils.data.Dataset):
    """Item i: x (8 features) whose first entry is i, and y."""

    def __len__(self) -> int:
        return cases.NUM_SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=g)
        x[0] = float(i)
        return {"x": x, "y": torch.randn(4, generator=g), "idx": torch.tensor(i)}


@pytest.fixture(scope="module")
def analysis(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("analysis")
    kw = cases.analyzer_kwargs(torch, num_workers=1, num_threads=1, num_threads_reduce=1)
    analyzer = DataAnalyzer(cases.MetricDataset(), save_path=str(root), **kw)
    analyzer.run_map()
    analyzer.run_reduce()
    return root


def _config(name: str, root: Path, tmp: Path) -> dict[str, Any]:
    case = cases.SAMPLER_CASES[name]
    section = copy.deepcopy(cases.sampler_config(name, case, str(root)))
    section["data_sampling"]["curriculum_learning"]["data_cluster_path"] = str(tmp / "clusters")
    return base_config(
        train_micro_batch_size_per_gpu=case["micro_batch_size"],
        gradient_accumulation_steps=case["gradient_accumulation_steps"],
        data_efficiency=section,
    )


def _train(engine: Any, loader: Any, steps: int) -> list[list[int]]:
    seen = []
    it = iter(loader)
    for _ in range(steps):
        batch = next(it)
        seen.append(batch["idx"].tolist())
        loss = torch.nn.functional.mse_loss(engine(batch["x"]), batch["y"])
        engine.backward(loss)
        engine.step()
    return seen


def test_training_loader_draws_deepspeeds_curriculum_order(analysis: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_net(), _config("value_fixed_linear", analysis, tmp_path), training_data=TrainSet())
    assert isinstance(engine.training_dataloader, CurriculumDataLoader)
    assert engine.curriculum_learning_enabled() and engine.data_efficiency_enabled()
    assert engine.curriculum_learning_config()["curriculum_metrics"]["seqlen"]["schedule_type"] == "fixed_linear"
    difficulties = []
    engine.set_data_post_process_func(
        lambda batch, state: difficulties.append(state["current_difficulties"]["seqlen"]) or batch
    )
    seen = _train(engine, engine.training_dataloader, 30)  # 15 curriculum steps of 2 micro batches
    assert seen == RECORDED["value_fixed_linear"][:30]
    # the data seen at each step is within that step's difficulty (sequence length <= difficulty)
    assert all(cases.SEQLEN[i] <= d for mb, d in zip(seen, difficulties, strict=False) for i in mb)
    assert difficulties[0] == 8 and difficulties[19] == 40 and difficulties[-1] == 50  # total_curriculum_step 12


def test_custom_schedule_reaches_the_sampler_and_deepspeed_io(analysis: Path, tmp_path: Path) -> None:
    engine = make_engine(tiny_net(), _config("custom_and_single_cluster", analysis, tmp_path), training_data=TrainSet())
    engine.set_custom_curriculum_learning_schedule({"seqlen": cases.CUSTOM["five_per_step"]})
    assert _train(engine, engine.training_dataloader, 12) == RECORDED["custom_and_single_cluster"][:12]
    loader = engine.deepspeed_io(TrainSet())
    assert isinstance(loader, CurriculumDataLoader) and loader.batch_size == 2


def test_checkpoint_resumes_the_sampler(analysis: Path, tmp_path: Path) -> None:
    cfg = _config("value_fixed_linear", analysis, tmp_path)
    whole = RECORDED["value_fixed_linear"][:30]
    engine = make_engine(tiny_net(), cfg, training_data=TrainSet())
    assert _train(engine, engine.training_dataloader, 12) == whole[:12]
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    state = torch.load(next((tmp_path / "ckpt").rglob("mp_rank_00_model_states.pt")), weights_only=False)
    assert state["data_sampler"]["consumed_samples"] == 12 * 4 and state["data_sampler"]["curriculum_step"] == 6
    resumed = make_engine(tiny_net(), cfg, training_data=TrainSet())
    resumed.load_checkpoint(str(tmp_path / "ckpt"))
    assert _train(resumed, resumed.training_dataloader, 18) == whole[12:30]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda s: s["data_sampling"]["curriculum_learning"].pop("data_cluster_path"),
            "data_efficiency.data_sampling.curriculum_learning.data_cluster_path: is required",
        ),
        (
            lambda s: s["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen"].update(
                schedule_type="fixed_cubic"
            ),
            "curriculum_learning.curriculum_metrics.seqlen.schedule_type: 'fixed_cubic' is not a schedule",
        ),
        (
            lambda s: s["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen"]["schedule_config"].pop(
                "difficulty_step"
            ),
            "curriculum_metrics.seqlen.schedule_config.difficulty_step: is required by schedule_type 'fixed_linear'",
        ),
        (
            lambda s: s["data_sampling"]["curriculum_learning"]["curriculum_metrics"]["seqlen"].update(
                difficulty_type="rank"
            ),
            "curriculum_metrics.seqlen.difficulty_type: 'rank' is not a difficulty type",
        ),
        (lambda s: s["data_sampling"].update(num_epochs=0), "data_efficiency.data_sampling.num_epochs: must be >= 1"),
        (
            lambda s: s["data_sampling"].update(dynamic_batching={"enabled": True}),
            "data_efficiency.data_sampling.dynamic_batching.max_tokens: must be an int > 0",
        ),
        (
            lambda s: s["data_sampling"].update(dynamic_batching={"lr_scaling_method": "cubic"}),
            "data_efficiency.data_sampling.dynamic_batching.lr_scaling_method",
        ),
    ],
)
def test_bad_values_are_refused_naming_the_key(change: Any, message: str, tmp_path: Path) -> None:
    cfg = _config("value_fixed_linear", tmp_path, tmp_path)
    change(cfg["data_efficiency"])
    with pytest.raises(DeepSpeedConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        DeepSpeedConfig(cfg)


def test_random_ltd_switched_on_without_its_settings_is_refused(tmp_path: Path) -> None:
    cfg = base_config(data_efficiency={"data_routing": {"random_ltd": {"enabled": True}}})
    with pytest.raises(DeepSpeedConfigError, match=r"data_routing\.random_ltd: .*total_layer_num"):
        DeepSpeedConfig(cfg)


def test_explain_shows_the_sampling_choices(tmp_path: Path) -> None:
    from ds_engine.explain import explain

    cfg = _config("two_metrics", tmp_path, tmp_path)
    cfg["data_efficiency"]["data_sampling"]["dynamic_batching"] = {"enabled": True, "max_tokens": 64}
    text = explain(DeepSpeedConfig(cfg), device_type="cpu")
    assert "curriculum sampling (DeepSpeedDataSampler, seed 99, 2 epochs, 0 loader workers)" in text
    assert "metric seqlen: value-based, fixed_discrete difficulties [10, 30, 50] until steps [3, 6]" in text
    assert "metric vocab: percentile-based, fixed_linear 40 -> 100 over 8 steps, in multiples of 20" in text
    assert "dynamic batching: micro batches of at most 64 tokens (min 1 sequences, picked in dataloader order)" in text
    assert "data sampling" not in explain(DeepSpeedConfig(base_config()), device_type="cpu")
