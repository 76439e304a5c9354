"""`deepspeed.runtime.zero.offload_states.get_state_devices`: where each kind of state is around offload/reload.

On a CPU host every device is "cpu", so what these tests can tell apart is "held somewhere" from "held
nowhere": gradient memory `offload_states()` releases as dead counts nowhere until `reload_states()`, a
state that holds nothing (stage 3's gradients after a step) is an empty set, and what is copied out (the
device-to-host path, forced with `StateOffloader.copy_on_same_device`) is on the copy's device.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

pytest.importorskip("ds_zero", reason="deepspeed.runtime.zero needs ds-zero: pip install 'ds-engine[zero]'")

from ds_engine.runtime.zero.offload_states import get_state_devices  # noqa: E402
from ds_ops import OffloadStateTypeEnum, StateOffloader  # noqa: E402

CPU = {torch.device("cpu")}
KINDS = list(OffloadStateTypeEnum)


@pytest.fixture
def copy_out() -> Iterator[None]:
    """Take the device-to-host path on this CPU host, and restore the default after the test."""
    StateOffloader.copy_on_same_device = True
    try:
        yield
    finally:
        StateOffloader.copy_on_same_device = False


def _trained(stage: int, steps: int = 1) -> Any:
    if stage:
        pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")
    import ds_engine

    with ds_engine.zero.Init() if stage == 3 else contextlib.nullcontext():
        model = tiny_net(0)
    engine = make_engine(model, base_config(zero_optimization={"stage": stage}))
    for x, y in batches(steps, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return engine


def _devices(engine: Any) -> dict[str, set[torch.device]]:
    return {k.value: get_state_devices(engine, k) for k in KINDS}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_after_a_step_gradients_are_released_and_come_back(stage: int, copy_out: None) -> None:
    engine = _trained(stage)
    before = _devices(engine)
    # fp32 at stage 0 trains the model's own parameters: there are no separate masters
    masters = set() if stage == 0 else CPU
    assert before["optim_states"] == before["lp_params"] == CPU and before["hp_params"] == masters
    # the zeroed gradient accumulators are still allocated (stage 0 accumulates in a flat buffer)
    grads = "contiguous_grad_buffer" if stage == 0 else "lp_grads"
    assert before[grads] == CPU
    engine.offload_states()
    after = _devices(engine)
    # copied out: on the copy's device; the zeroed gradient memory was dropped: nowhere
    assert after["optim_states"] == after["lp_params"] == CPU and after["hp_params"] == masters
    assert after[grads] == set()
    engine.reload_states()
    assert _devices(engine) == before


def test_stage3_gradients_hold_nothing_after_a_step() -> None:
    engine = _trained(3)
    devices = _devices(engine)
    assert devices["lp_grads"] == set() and devices["contiguous_grad_buffer"] == set()
    assert devices["optim_states"] == devices["hp_params"] == devices["lp_params"] == CPU


@pytest.mark.parametrize("stage", [0, 2])
def test_names_are_accepted_and_unknown_states_refused(stage: int) -> None:
    engine = _trained(stage)
    assert get_state_devices(engine, "optim_states") == get_state_devices(engine, OffloadStateTypeEnum.optim_states)
    with pytest.raises(ValueError, match="unknown state 'adam_moments'; valid: optim_states"):
        get_state_devices(engine, "adam_moments")


def test_needs_an_engine() -> None:
    with pytest.raises(TypeError, match=r"needs the engine deepspeed.initialize\(\) returned, got TinyNet"):
        get_state_devices(tiny_net(0), OffloadStateTypeEnum.lp_params)  # type: ignore[arg-type]


def test_before_any_step_optimizer_state_is_nowhere() -> None:
    # torch's Adam creates its moments at the first step
    engine = _trained(0, steps=0)
    assert get_state_devices(engine, OffloadStateTypeEnum.optim_states) == set()
    assert get_state_devices(engine, OffloadStateTypeEnum.lp_params) == CPU
