"""DeepSpeed's stage-3 gradient views on 2 ranks: `get_fp32_grad_partitions()`, `averaged_gradients` and
`grad_partitions_flat_buffer`.

The reference is plain torch: the full gradient of each parameter, averaged over both ranks' batches and
accumulated over two backwards; rank r's expected partition is elements `[r * s, (r + 1) * s)` of it
flattened, `s = ceil(numel / 2)`, zero-padded on the last rank (the weights have odd sizes). Keys are
DeepSpeed's: sub-group (tile) index, then the parameter's index in it; a small `sub_group_size` makes
several tiles. Both are empty with no gradient in the window (before the first backward, after `zero_grad`,
which the engine's step ends with), and are views: a write changes what the step uses. The flat buffer is
the partitions end to end (one param group: the live gradient itself), all zeros with no gradient.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks

SIZES = [(3, 5), (5, 3), (7,)]  # 15, 15, 7 elements: every partition of rank 1 is padded


class Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.ParameterList(nn.Parameter(torch.randn(*s) * 0.5) for s in SIZES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(x @ self.w[0])  # (b, 3) @ (3, 5)
        h = torch.tanh(h @ self.w[1])  # (b, 5) @ (5, 3)
        return (h.sum(dim=1, keepdim=True) * self.w[2]).pow(2).mean()


def _batch(rank: int, micro: int) -> torch.Tensor:
    return torch.randn(4, 3, generator=torch.Generator().manual_seed(100 * micro + rank))


def _expected(rank: int, world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ref = Chain()
    for micro in range(2):
        for r in range(world):
            (ref(_batch(r, micro)) / world).backward()
    out = []
    for p in ref.w:
        s = math.ceil(p.numel() / world)
        padded = torch.zeros(s * world)
        padded[: p.numel()] = p.grad.reshape(-1)
        out.append(padded[rank * s : (rank + 1) * s])
    return out


def _views(rank: int, world: int, sub_group_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Chain()
    cfg = {"stage": 3, "param_persistence_threshold": 0, "sub_group_size": sub_group_size}
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    out: dict[str, Any] = {"before": opt.get_fp32_grad_partitions(), "tiles": [len(g) for g in opt.fp16_groups]}
    for micro in range(2):
        opt.backward(model(_batch(rank, micro)))
    parts = opt.get_fp32_grad_partitions()
    out["keys"] = {g: sorted(d) for g, d in parts.items()}
    out["grads"] = [parts[g][i].clone() for g, d in sorted(parts.items()) for i in sorted(d)]
    out["dtypes"] = {parts[g][i].dtype for g, d in parts.items() for i in d}
    flat = opt.grad_partitions_flat_buffer
    out["flat"] = flat.clone()
    out["flat_is_live"] = flat.data_ptr() == parts[0][0].data_ptr()
    averaged = opt.averaged_gradients
    out["averaged_same"] = all(
        averaged[g][i].data_ptr() == parts[g][i].data_ptr() for g, d in parts.items() for i in d
    ) and sorted(averaged) == sorted(parts)
    # a view: doubling the first partition doubles what the step applies to it
    first = model.w[0]
    before = opt.get_local_fp32_param(first).clone()
    parts[0][0].mul_(2.0)
    opt.step()
    out["step_delta"] = before - opt.get_local_fp32_param(first)
    opt.zero_grad()
    out["after_step"] = opt.get_fp32_grad_partitions()
    opt.backward(model(_batch(rank, 0)))
    out["again"] = sorted(opt.averaged_gradients)
    opt.zero_grad()
    out["after_zero_grad"] = opt.averaged_gradients
    out["flat_after_zero_grad"] = opt.grad_partitions_flat_buffer.clone()
    opt.destroy()
    return out


def _two_groups(rank: int, world: int) -> dict[str, Any]:
    """Two param groups: the flat buffer is both partitions end to end, a copy."""
    torch.manual_seed(0)
    model = Chain()
    groups = [{"params": list(model.w[:2])}, {"params": [model.w[2]], "lr": 0.2}]
    cfg = {"stage": 3, "param_persistence_threshold": 0}
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(groups, lr=0.1), config=cfg)
    for micro in range(2):
        opt.backward(model(_batch(rank, micro)))
    flat = opt.grad_partitions_flat_buffer
    out = {"flat": flat.clone(), "copy": all(flat.data_ptr() != p.master.grad.data_ptr() for p in opt.partitions)}
    opt.destroy()
    return out


def _run(rank: int, world: int) -> dict[str, Any]:
    return {
        "one_tile": _views(rank, world, 1_000_000_000),
        "tiles": _views(rank, world, 8),
        "two_groups": _two_groups(rank, world),
        "ref": _expected(rank, world),
    }


def test_grad_partitions_are_each_ranks_slice_of_the_averaged_accumulated_gradient() -> None:
    for rank, result in enumerate(run_ranks(2, _run, timeout_s=120)):
        ref = result["ref"]
        for name, keys in (("one_tile", {0: [0, 1, 2]}), ("tiles", {0: [0], 1: [0], 2: [0]})):
            r = result[name]
            assert r["tiles"] == [len(v) for v in keys.values()], (rank, name, r["tiles"])
            assert r["before"] == {} and r["after_step"] == {} and r["after_zero_grad"] == {}, (rank, name)
            assert r["keys"] == keys and r["again"] == sorted(keys), (rank, name, r["keys"])
            assert r["dtypes"] == {torch.float32}
            assert r["averaged_same"], (rank, name)
            torch.testing.assert_close(r["flat"], torch.cat(ref), rtol=1e-5, atol=1e-6)
            assert r["flat_is_live"]  # one param group: the gradient itself, not a copy
            assert r["flat_after_zero_grad"].shape == r["flat"].shape and not r["flat_after_zero_grad"].any()
            for got, want in zip(r["grads"], ref, strict=True):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
            if rank == 1:  # 15 and 7 elements over 2 ranks: the last element of each partition is padding
                assert all(float(g[-1]) == 0.0 for g in r["grads"])
            torch.testing.assert_close(r["step_delta"], 0.1 * 2.0 * ref[0], rtol=1e-5, atol=1e-6)
        two = result["two_groups"]
        torch.testing.assert_close(two["flat"], torch.cat(ref), rtol=1e-5, atol=1e-6)
        assert two["copy"]
