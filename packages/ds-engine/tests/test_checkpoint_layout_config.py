"""`checkpoint.layout`: its values, and the setups DeepSpeed's layout cannot hold, refused in initialize()
before any work, naming `checkpoint.layout` and the feature."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import torch
from ds_engine_testkit import base_config, flat_params, tiny_net

import ds_engine
from ds_comm.testing import run_ranks
from ds_engine import DeepSpeedConfigError
from ds_engine._checkpoint.deepspeed_layout import check_deepspeed_layout
from ds_engine.config import DeepSpeedConfig

_LAYOUT = r'checkpoint.layout="deepspeed" cannot be written with '
needs_zero = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero (ZeRO configs)")


def _refused(config: dict, message: str, model: torch.nn.Module | None = None) -> None:
    model = model if model is not None else tiny_net(0)
    before = flat_params(model)
    with pytest.raises(DeepSpeedConfigError, match=message):
        ds_engine.initialize(model=model, config=config, dist_init_required=False)
    assert torch.equal(flat_params(model), before)


def test_unset_is_decided_by_initialize_and_a_bad_value_names_the_key_and_the_values() -> None:
    assert DeepSpeedConfig(base_config(), world_size=1).parsed.checkpoint.layout is None
    _refused(base_config(checkpoint={"layout": "DeepSpeed"}), r"checkpoint.layout: Input should be 'ds' or 'deepspeed'")


@needs_zero
def test_nvme_offload_is_refused(tmp_path: Path) -> None:
    zero = {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}}
    config = base_config(zero_optimization=zero, checkpoint={"layout": "deepspeed"})
    _refused(config, _LAYOUT + r"NVMe offload \(zero_optimization.offload_optimizer.device='nvme'")


class _WithMoE(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from ds_parallel.moe import MoE

        self.moe = MoE(8, torch.nn.Linear(8, 8), num_experts=2, ep_size=1, k=1, min_capacity=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.moe(x)[0]


def _moe_refusal(rank: int, world: int) -> str:
    torch.manual_seed(0)
    config = base_config(zero_optimization={"stage": 1}, checkpoint={"layout": "deepspeed"})
    with pytest.raises(DeepSpeedConfigError) as err:
        ds_engine.initialize(model=_WithMoE(), config=config, dist_init_required=False)
    return str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.skipif(importlib.util.find_spec("ds_parallel") is None, reason="needs ds-parallel")
@needs_zero
def test_moe_is_refused() -> None:  # MoE layers need a process group: one gloo rank
    message = run_ranks(1, _moe_refusal, timeout_s=100)[0]
    assert re.search(_LAYOUT + r"MoE layers", message), message


@pytest.mark.parametrize(
    ("stage", "kwargs", "message"),
    [
        (2, {"pipeline": True}, r"a pipeline at ZeRO stage 2 \(DeepSpeed's PipelineEngine takes ZeRO stage 0 or 1\)"),
        (1, {"tp_size": 2, "mp_world_size": 2}, r"tensor \(model\) parallelism \(2 model-parallel ranks"),
        (1, {"mp_world_size": 2}, r"tensor \(model\) parallelism"),
        (2, {"sp_size": 2}, r"sequence parallelism \(sequence_parallel_size=2\)"),
    ],
)
@needs_zero
def test_what_deepspeeds_layout_cannot_hold_is_refused(stage: int, kwargs: dict, message: str) -> None:
    args = {"pipeline": False, "tp_size": 1, "mp_world_size": 1, "sp_size": 1, **kwargs}
    for layout in ("ds", "deepspeed"):
        config = DeepSpeedConfig(
            base_config(zero_optimization={"stage": stage}, checkpoint={"layout": layout}), world_size=1
        )
        if layout == "ds":
            check_deepspeed_layout(config, **args)  # ds's own layout holds all of these
            continue
        with pytest.raises(DeepSpeedConfigError, match=_LAYOUT + message + r'.*or use checkpoint.layout="ds"'):
            check_deepspeed_layout(config, **args)


@needs_zero
def test_a_pipeline_at_zero_1_and_plain_data_parallelism_are_accepted() -> None:
    config = DeepSpeedConfig(
        base_config(zero_optimization={"stage": 1}, checkpoint={"layout": "deepspeed"}), world_size=1
    )
    check_deepspeed_layout(config, pipeline=True, tp_size=1, mp_world_size=2, sp_size=1)
    check_deepspeed_layout(config, pipeline=False, tp_size=1, mp_world_size=1, sp_size=1)
