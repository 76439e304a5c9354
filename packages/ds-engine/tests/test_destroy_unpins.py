"""`engine.destroy()` destroys the optimizer: with ZeRO optimizer offload under DS_PIN_MEMORY_BACKEND=native,
the page-locked host buffers are freed then, not at garbage collection."""

from __future__ import annotations

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

import ds_comm
from ds_comm import native_pinned_memory as npm


@pytest.fixture(autouse=True)
def _fresh_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(npm, "_shared_native_pins", None)


def _offload_config(stage: int) -> dict:
    return base_config(
        zero_optimization={"stage": stage, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        zero_force_ds_cpu_optimizer=False,
    )


@pytest.mark.parametrize("stage", [1, 2])
def test_destroy_frees_native_offload_pins(stage: int, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ds_zero")
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    engine = make_engine(tiny_net(), _offload_config(stage))
    x, y = batches(1, 4)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    pins = npm.get_active_native_pinned_memory()
    assert len(pins._ranges) > 0 and all(ds_comm.get_accelerator().is_pinned(m) for m in engine.optimizer.masters)
    engine.destroy()
    assert pins._ranges == {}


def test_torch_backend_destroy_frees_nothing_and_masters_stay_readable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("ds_zero")
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    engine = make_engine(tiny_net(), _offload_config(2))
    x, y = batches(1, 4)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    before = [m.clone() for m in engine.optimizer.masters]
    engine.destroy()
    assert npm.get_active_native_pinned_memory() is None
    for master, copy in zip(engine.optimizer.masters, before, strict=True):
        torch.testing.assert_close(master, copy, rtol=0, atol=0)
