"""Stage-3 memory, measured from the tensors each rank holds.

* A model built under `ds_zero.Init` never exists whole on a rank: each rank's parameter bytes are 1/N
  (plus padding), and its RSS grows by well under the model's size while building it.
* The gathered parameters never exceed `stage3_max_live_parameters` plus one module, measured at every
  module boundary of forward and backward from the parameters' storages.
* Parameter and optimizer offload train the same as without.
"""

from __future__ import annotations

import ctypes
import math
import os
from typing import Any

import pytest
import torch
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks
from ds_zero._params.partitioned_param import state_of

WIDTH, LAYERS = 2048, 6  # 25M parameters, 100 MB in fp32
LAYER_BYTES = (WIDTH * WIDTH + WIDTH) * 4
# First-touch overheads of the process (allocator, RNG, lazy imports, the gather group's gloo buffers):
# 16 MiB was exceeded by 2 MiB once in CI. The budget stays below the model (50 + 16 + 24 < 100 MB), so
# a rank that materialised the whole model still fails; the exact per-tensor figure is `held` below.
SLACK_BYTES = 24 * 2**20


_M_MMAP_THRESHOLD = -3


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Tower(nn.Module):
    def __init__(self, width: int, layers: int, probe: list[int] | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(layers):
            self.layers.append(nn.Linear(width, width))
            if probe is not None:
                probe.append(_rss())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _held_bytes(model: nn.Module) -> int:
    """Bytes of every distinct storage a parameter references (shard, full storage, placeholder)."""
    seen: dict[int, int] = {}
    for p in model.parameters():
        for t in (p.ds_tensor, state_of(p).full_flat, p.data):
            storage = t.untyped_storage()
            seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _build_under_init(rank: int, world: int) -> dict[str, Any]:
    # glibc otherwise keeps freed multi-MB blocks in its heap (dynamic mmap threshold), so RSS would
    # measure the allocator's caching instead of what the tensors hold
    ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, 128 * 1024)
    # A first Init imports its config machinery (pydantic and ds_zero.config: 5-10 MB, more where the venv holds no
    # compiled bytecode, as uv's do not); a tiny warm-up build pays that before the measurement starts, so the
    # growth counts what building the model holds.
    with ds_zero.Init():
        Tower(64, 1)
    torch.manual_seed(0)
    base = _rss()
    samples: list[int] = []
    with ds_zero.Init():
        model = Tower(WIDTH, LAYERS, probe=samples)
    growth_init = max(samples) - base
    shapes_ok = all(p.shape == p.ds_shape and p.numel() == p.ds_numel for p in model.parameters())
    expected = sum(math.ceil(p.ds_numel / world) * 4 + 4 for p in model.parameters())  # shard + placeholder
    held = _held_bytes(model)
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    del model
    base = _rss()
    samples = []
    plain = Tower(WIDTH, LAYERS, probe=samples)
    growth_plain = max(samples) - base
    return {
        "held": held,
        "expected": expected,
        "full": full_bytes,
        "growth_init": growth_init,
        "growth_plain": growth_plain,
        "shapes_ok": shapes_ok,
        "plain_params": sum(p.numel() for p in plain.parameters()),
    }


def test_model_built_under_init_holds_one_nth_per_rank() -> None:
    world = 2
    results = run_ranks(world, _build_under_init, timeout_s=180)
    for r in results:
        assert r["shapes_ok"]
        assert r["held"] == r["expected"]  # exactly the shards (padded to N) and a 1-element placeholder each
        assert r["held"] <= r["full"] / world + LAYERS * 2 * 8
        # building never held the model: each rank is allowed half of it plus one layer (and process
        # overheads), which the plain build exceeds
        allowed = r["full"] / world + LAYER_BYTES + SLACK_BYTES
        assert allowed < r["full"] < r["growth_plain"] * 1.05, r
        assert r["growth_init"] < allowed, r


def _gathered_numel(model: nn.Module) -> int:
    return sum(state_of(p).full_flat.untyped_storage().nbytes() // p.element_size() for p in model.parameters())


class _MeasuredLinearFn(torch.autograd.Function):
    """A linear layer that records how many parameter elements are gathered, in its forward and backward."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, model: nn.Module, log: list[int]
    ) -> torch.Tensor:
        log.append(_gathered_numel(model))
        ctx.save_for_backward(x, w)
        ctx.model, ctx.log = model, log
        return x @ w.t() + b

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        x, w = ctx.saved_tensors
        ctx.log.append(_gathered_numel(ctx.model))
        return grad @ w, grad.t() @ x, grad.sum(0), None, None


class MeasuredLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _MeasuredLinearFn.apply(x, self.weight, self.bias, self.__dict__["root"], self.__dict__["log"])


class ProbedTower(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.log: list[int] = []
        self.layers = nn.ModuleList(MeasuredLinear(64, 64) for _ in range(8))
        for layer in self.layers:
            layer.__dict__.update(root=self, log=self.log)  # plain attributes, not submodules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


MODULE_NUMEL = 64 * 64 + 64


def _peak_gathered(rank: int, world: int, max_live: int, bucket: int = 2 * MODULE_NUMEL) -> dict[str, Any]:
    torch.manual_seed(0)
    model = ProbedTower()
    cfg = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_prefetch_bucket_size": bucket,
        "stage3_max_live_parameters": max_live,
        "stage3_max_reuse_distance": 0,
    }
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    for step in range(3):
        model.log.clear()
        x = torch.randn(4, 64, generator=torch.Generator().manual_seed(step + rank))
        opt.backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return {
        "measured": max(model.log),
        "counted": opt.parameter_offload.peak_live_numel,
        "after": _gathered_numel(model),
    }


def _peak_gathered_budgets(rank: int, world: int, budgets: list[int]) -> dict[int, dict[str, Any]]:
    return {max_live: _peak_gathered(rank, world, max_live) for max_live in budgets}


def test_peak_gathered_stays_within_max_live_parameters_plus_one_module() -> None:
    budgets = [2 * MODULE_NUMEL, 3 * MODULE_NUMEL + 100]
    for by_budget in run_ranks(2, _peak_gathered_budgets, budgets=budgets, timeout_s=120):
        for max_live, r in by_budget.items():
            _check_peak(max_live, r)


def _peak_gathered_small_bucket(rank: int, world: int) -> dict[str, Any]:
    return _peak_gathered(rank, world, 10 * MODULE_NUMEL, bucket=MODULE_NUMEL // 2)


def test_a_prefetch_bucket_smaller_than_one_module_still_prefetches_one() -> None:
    """DeepSpeed's bucket is a threshold (prefetch while less is on its way), not a cap: Hugging Face's "auto"
    bucket, 0.9 * hidden**2, is below one hidden x hidden weight and must not switch prefetching off."""
    for r in run_ranks(2, _peak_gathered_small_bucket, timeout_s=120):
        # with reuse distance 0 only a prefetch makes a second module live while one runs
        assert r["measured"] == 2 * MODULE_NUMEL, r
        assert r["counted"] == 2 * MODULE_NUMEL, r
        assert r["after"] == 0, r


def _check_peak(max_live: int, r: dict[str, Any]) -> None:
    assert r["measured"] <= max_live + MODULE_NUMEL, r
    assert r["counted"] <= max_live + MODULE_NUMEL, r
    assert r["counted"] > MODULE_NUMEL, r  # prefetching did use the budget
    if max_live >= 3 * MODULE_NUMEL:  # a 2-module prefetch batch lands while the next module runs
        assert r["measured"] > MODULE_NUMEL, r
    assert r["after"] == 0, r  # everything released after the step


def _offload_losses(rank: int, world: int, offload: bool, cpu_adam: bool) -> dict[str, Any]:
    from stage3_cases import batch, loss_fn, make_model

    cfg: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 40}
    if offload:
        cfg["offload_param"] = {"device": "cpu", "pin_memory": True}
        cfg["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    model = make_model()
    params = [p for p in model.parameters() if p.requires_grad]
    if cpu_adam:
        import ds_ops

        base = ds_ops.DeepSpeedCPUAdam(params, lr=1e-2, adamw_mode=True, weight_decay=0.01)
    else:
        base = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=cfg)
    losses = []
    for step in range(4):
        idx, tgt = batch(rank, step, 0)
        loss = loss_fn(model(idx), tgt)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "shard_devices": {p.ds_tensor.device.type for p in model.parameters()},
        "master_devices": {part.master.device.type for part in opt.partitions},
        "offloaded": all(
            state_of(p).offload == offload or p.ds_tensor.device == state_of(p).full.device for p in model.parameters()
        ),
    }


def _offload_pair(rank: int, world: int, cpu_adam: bool) -> dict[str, Any]:
    return {
        "plain": _offload_losses(rank, world, False, False),
        "offload": _offload_losses(rank, world, True, cpu_adam),
    }


def test_parameter_and_optimizer_offload_train_like_no_offload() -> None:
    r = run_ranks(2, _offload_pair, cpu_adam=False, timeout_s=120)[0]
    assert r["offload"]["shard_devices"] == {"cpu"} and r["offload"]["master_devices"] == {"cpu"}
    torch.testing.assert_close(torch.tensor(r["offload"]["losses"]), torch.tensor(r["plain"]["losses"]), atol=0, rtol=0)


def test_optimizer_offload_with_ds_ops_cpu_adam() -> None:
    ds_ops = pytest.importorskip("ds_ops")
    if not hasattr(ds_ops, "DeepSpeedCPUAdam"):
        pytest.skip("needs ds_ops.DeepSpeedCPUAdam (the ds-ops CPU optimizers)")
    r = run_ranks(2, _offload_pair, cpu_adam=True, timeout_s=120)[0]
    torch.testing.assert_close(
        torch.tensor(r["offload"]["losses"]), torch.tensor(r["plain"]["losses"]), atol=1e-5, rtol=1e-5
    )
