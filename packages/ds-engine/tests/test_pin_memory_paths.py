"""`deepspeed.ops.op_builder.PinMemoryBuilder` is ds-ops' op, and it is where native pinned memory comes from:
replacing it in that module changes what `NativePinnedMemory()` loads, as in DeepSpeed."""

from __future__ import annotations

import pytest
import torch

import ds_comm
import ds_ops.op_builder
from ds_comm import native_pinned_memory as npm
from ds_engine.ops import op_builder


def test_the_builder_is_ds_ops_pin_memory_op() -> None:
    assert op_builder.PinMemoryBuilder is ds_ops.op_builder.PinMemoryBuilder
    assert "PinMemoryBuilder" in op_builder.__all__


def test_native_pins_come_from_this_modules_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    loads: list[str] = []

    class CountingBuilder(ds_ops.op_builder.PinMemoryBuilder):
        def load(self, verbose: bool = True) -> ds_ops.op_builder.PinMemoryOp:
            loads.append("load")
            return super().load(verbose)

    monkeypatch.setattr(op_builder, "PinMemoryBuilder", CountingBuilder)
    pins = npm.NativePinnedMemory()
    assert loads == ["load"] and pins._handle is ds_comm.locked_host_allocator()
    assert pins.unpin(pins.pin(torch.ones(3))) is True


def test_a_builder_that_fails_fails_the_native_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    class Failing:
        def load(self) -> None:
            raise OSError("simulated build failure")

    monkeypatch.setattr(op_builder, "PinMemoryBuilder", Failing)
    monkeypatch.setattr(npm, "_shared_native_pins", None)
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    with pytest.raises(RuntimeError, match="needs the pin_memory op.*simulated build failure"):
        npm.get_active_native_pinned_memory()
