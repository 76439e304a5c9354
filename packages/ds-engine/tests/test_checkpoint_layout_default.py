"""An unset `checkpoint.layout`: ds's layout, or DeepSpeed's under the `deepspeed` distribution where it can hold
the job; otherwise ds's, with one warning on rank 0 that names what DeepSpeed's layout cannot hold.

`ds_engine.config.set_default_checkpoint_layout` is the process-wide setting the `deepspeed` distribution
sets on import (`packages/deepspeed/tests` checks that); here it is set and restored around each test.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_engine._checkpoint.deepspeed_layout import resolve_checkpoint_layout
from ds_engine.config import DeepSpeedConfig, default_checkpoint_layout, set_default_checkpoint_layout

needs_zero = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero (ZeRO configs)")
_PLAIN = {"pipeline": False, "tp_size": 1, "mp_world_size": 1, "sp_size": 1, "has_moe": False, "rank": 0}


@pytest.fixture(autouse=True)
def ds_engine_default() -> Iterator[None]:
    """ds-engine's own default for each test, whatever an earlier test in this process imported (`import
    deepspeed` sets DeepSpeed's)."""
    before = default_checkpoint_layout()
    set_default_checkpoint_layout("ds")
    try:
        yield
    finally:
        set_default_checkpoint_layout(before)


@pytest.fixture
def deepspeed_default() -> None:
    """The default `import deepspeed` sets, for one test (`ds_engine_default` restores it)."""
    set_default_checkpoint_layout("deepspeed")


def _resolved(config: dict, **kwargs: object) -> str | None:
    ds_config = DeepSpeedConfig(config, world_size=1)
    return resolve_checkpoint_layout(ds_config, **{**_PLAIN, **kwargs}).parsed.checkpoint.layout


@needs_zero
def test_unset_is_ds_under_ds_engine() -> None:
    assert _resolved(base_config(zero_optimization={"stage": 2})) == "ds"


def test_a_bad_default_is_refused() -> None:
    with pytest.raises(ValueError, match="layout must be 'ds' or 'deepspeed', got 'DeepSpeed'"):
        set_default_checkpoint_layout("DeepSpeed")  # type: ignore[arg-type]


@needs_zero
@pytest.mark.usefixtures("deepspeed_default")
def test_unset_is_deepspeed_under_the_deepspeed_default_and_an_explicit_value_wins() -> None:
    assert _resolved(base_config(zero_optimization={"stage": 3})) == "deepspeed"
    assert _resolved(base_config(zero_optimization={"stage": 3}, checkpoint={"layout": "ds"})) == "ds"
    raw = base_config(zero_optimization={"stage": 3})
    config = resolve_checkpoint_layout(DeepSpeedConfig(raw, world_size=1), **_PLAIN)
    assert "checkpoint" not in config.raw  # what checkpoints store as the user's config is untouched


@needs_zero
@pytest.mark.usefixtures("deepspeed_default")
@pytest.mark.parametrize(
    ("stage", "kwargs", "zero", "reason"),
    [
        (2, {"pipeline": True}, {}, "a pipeline at ZeRO stage 2"),
        (1, {"tp_size": 2, "mp_world_size": 2}, {}, "tensor (model) parallelism"),
        (2, {"sp_size": 2}, {}, "sequence parallelism"),
        (1, {"has_moe": True}, {}, "MoE layers"),
        (3, {}, {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, "NVMe offload"),
    ],
)
def test_what_deepspeeds_layout_cannot_hold_falls_back_to_ds_with_a_warning_on_rank_0(
    stage: int, kwargs: dict, zero: dict, reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = base_config(zero_optimization={"stage": stage, **zero})
    with caplog.at_level(logging.INFO, logger="ds_engine"):
        assert _resolved(config, **kwargs) == "ds"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "saved in ds's layout" in warnings[0].getMessage()
    assert reason in warnings[0].getMessage()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="ds_engine"):
        assert _resolved(config, **kwargs, rank=1) == "ds"
    assert not caplog.records  # other ranks stay quiet


def _save(tmp_path: Path, stage: int) -> list[str]:
    engine = make_engine(tiny_net(0), base_config(zero_optimization={"stage": stage}))
    x, y = batches(1, 4)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="t")
    return sorted(p.name for p in (tmp_path / "t").iterdir())


@needs_zero
def test_an_engine_saves_in_the_layout_the_default_gives(tmp_path: Path) -> None:
    assert _save(tmp_path / "ds", 3) == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    set_default_checkpoint_layout("deepspeed")
    try:
        files = _save(tmp_path / "deepspeed", 3)
    finally:
        set_default_checkpoint_layout("ds")
    assert files == ["zero_pp_rank_0_mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    assert sorted(p.name for p in (tmp_path / "deepspeed").iterdir() if p.is_file()) == [
        "latest",
        "zero_to_fp32.py",
        "zero_to_torch.py",
    ]
    torch.load(tmp_path / "deepspeed" / "t" / files[0], weights_only=False)  # a plain file DeepSpeed reads
