"""Optimizer offload buffers under the two pinned-memory backends: natively pinned when
`offload_optimizer.pin_memory` and DS_PIN_MEMORY_BACKEND=native (training unchanged, exact against plain
torch), in huge pages with the CPU accelerator's torch backend, and freed by `destroy()`."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ds_comm
import ds_zero
from ds_comm import native_pinned_memory as npm


@pytest.fixture(autouse=True)
def _cpu_accelerator_and_fresh_pins(monkeypatch: pytest.MonkeyPatch) -> None:
    ds_comm.set_accelerator(ds_comm.accelerator.CpuAccelerator())
    monkeypatch.setattr(npm, "_shared_native_pins", None)
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    yield
    ds_comm.set_accelerator(None)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 4))


def _offload(pin_memory: bool) -> dict:
    return {"device": "cpu", "pin_memory": pin_memory}


def _zero(model: nn.Module, stage: int, pin_memory: bool) -> ds_zero.DeepSpeedZeroOptimizer:
    base = torch.optim.Adam(model.parameters(), lr=1e-2)
    if stage == 3:
        config = {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_optimizer": _offload(pin_memory)}
        return ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=config)
    config = ds_zero.ZeroConfig(stage=stage, offload_optimizer=_offload(pin_memory))
    return ds_zero.ZeroOptimizer(base, config=config, module=model)


def _train(model: nn.Module, opt: object | None, steps: int = 4) -> None:
    base = torch.optim.Adam(model.parameters(), lr=1e-2) if opt is None else None
    for step in range(steps):
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        if opt is None:
            loss.backward()
            base.step()
            base.zero_grad()
        else:
            opt.backward(loss)
            opt.step()
            opt.zero_grad()


def _host_buffers(opt: object, stage: int) -> list[torch.Tensor]:
    if stage == 3:
        return [part.master for part in opt.partitions]
    return [*opt.masters, *opt.grad_partitions]


def _params(model: nn.Module, opt: object, stage: int) -> list[torch.Tensor]:
    if stage == 3:
        with ds_zero.GatheredParameters(list(model.parameters())):
            return [p.detach().clone() for p in model.parameters()]
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_native_pinned_offload_trains_as_plain_torch_and_destroy_frees(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    ref = _model()
    model = copy.deepcopy(ref)
    opt = _zero(model, stage, pin_memory=True)
    accelerator = ds_comm.get_accelerator()
    buffers = _host_buffers(opt, stage)
    assert buffers and all(accelerator.is_pinned(b) for b in buffers)
    pins = npm.get_active_native_pinned_memory()
    assert len(pins._ranges) == len(buffers)
    _train(model, opt)
    _train(ref, None)
    for ours, theirs in zip(_params(model, opt, stage), ref.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    opt.destroy()
    assert pins._ranges == {}


def test_stage3_bf16_masters_pinned_natively_train_as_unpinned_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    # In fp32 on the host the stage-3 master is the parameter shard itself; with bf16 it is a separate
    # fp32 buffer, the one offload pins.
    runs = {}
    for backend in ("native", "torch"):
        monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", backend)
        model = _model().to(torch.bfloat16)
        opt = _zero(model, 3, pin_memory=True)
        masters = _host_buffers(opt, 3)
        assert all(m.dtype == torch.float32 for m in masters)
        assert all(ds_comm.get_accelerator().is_pinned(m) for m in masters) == (backend == "native")
        for step in range(3):
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
            opt.backward(model(x).float().pow(2).mean())
            opt.step()
            opt.zero_grad()
        runs[backend] = [m.clone() for m in masters]
        if backend == "native":
            pins = npm.get_active_native_pinned_memory()
            assert len(pins._ranges) == len(masters)
            opt.destroy()
            assert pins._ranges == {}
    for pinned, unpinned in zip(runs["native"], runs["torch"], strict=True):
        torch.testing.assert_close(pinned, unpinned, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [2, 3])
def test_pin_memory_false_or_torch_backend_uses_unpinned_host_memory(
    stage: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "native")
    opt = _zero(_model(), stage, pin_memory=False)
    assert npm.get_active_native_pinned_memory()._ranges == {}
    assert not any(ds_comm.get_accelerator().is_pinned(b) for b in _host_buffers(opt, stage))
    opt.destroy()
    monkeypatch.setenv("DS_PIN_MEMORY_BACKEND", "torch")
    model = _model()
    opt = _zero(model, stage, pin_memory=True)  # pinning is a no-op on the CPU accelerator with torch
    assert not any(ds_comm.get_accelerator().is_pinned(b) for b in _host_buffers(opt, stage))
    _train(model, opt, steps=1)
    opt.destroy()
