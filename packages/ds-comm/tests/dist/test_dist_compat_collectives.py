"""DeepSpeed's `allgather_fn`, `reduce_scatter_fn` and `all_gather_coalesced` on gloo ranks, against
torch.distributed's own collectives on the same data (exact: gathers copy, sums of small integers)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ds_comm
from ds_comm.testing import run_ranks

_torch_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_torch_reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _compare(rank: int, world: int) -> dict[str, object]:
    out: dict[str, object] = {}
    gen = torch.Generator().manual_seed(100 + rank)
    inp = torch.randint(-50, 50, (6,), generator=gen).float()
    mine, ref = torch.empty(6 * world), torch.empty(6 * world)
    ds_comm.allgather_fn(mine, inp)
    _torch_gather(ref, inp)
    out["allgather"] = (mine, ref)
    mine_async = torch.empty(6 * world)
    handle = ds_comm.allgather_fn(mine_async, inp, async_op=True)
    assert handle is not None
    handle.wait()
    out["allgather_async"] = (mine_async, ref)

    full = torch.randint(-9, 9, (4 * world,), generator=gen).to(torch.float64)
    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        mine_rs, ref_rs = torch.empty(4, dtype=torch.float64), torch.empty(4, dtype=torch.float64)
        ds_comm.reduce_scatter_fn(mine_rs, full, op=op)
        _torch_reduce_scatter(ref_rs, full.clone(), op=op)
        out[f"reduce_scatter_{name}"] = (mine_rs, ref_rs)
    mine_rs = torch.empty(4, dtype=torch.float64)
    handle = ds_comm.reduce_scatter_fn(mine_rs, full, async_op=True)
    assert handle is not None
    handle.wait()
    out["reduce_scatter_async"] = (mine_rs, out["reduce_scatter_sum"][1])  # type: ignore[index]

    # Mixed sizes and dtypes, gathered as one batch, synchronously and asynchronously.
    inputs = [
        torch.randint(-5, 5, (3,), generator=gen).float(),
        torch.randint(-5, 5, (2, 2), generator=gen).to(torch.int64).reshape(-1),
        torch.randint(-5, 5, (5,), generator=gen).to(torch.float64),
    ]
    refs = [torch.empty(world * t.numel(), dtype=t.dtype) for t in inputs]
    for r, t in zip(refs, inputs, strict=True):
        _torch_gather(r, t)
    for mode in ("sync", "async"):
        outputs = [torch.empty_like(r) for r in refs]
        result = ds_comm.all_gather_coalesced(outputs, inputs, async_op=mode == "async")
        if mode == "async":
            assert result is not None
            result.wait()
        else:
            assert result is None
        out[f"coalesced_{mode}"] = list(zip(outputs, refs, strict=True))
    # Same-dtype, same-size inputs (the gloo pair path takes these when there are two ranks).
    same = [torch.full((4,), float(rank * 10 + i)) for i in range(3)]
    same_out = [torch.empty(4 * world) for _ in same]
    same_ref = [torch.empty(4 * world) for _ in same]
    ds_comm.all_gather_coalesced(same_out, same)
    for r, t in zip(same_ref, same, strict=True):
        _torch_gather(r, t)
    out["coalesced_same"] = list(zip(same_out, same_ref, strict=True))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_compat_collectives_match_torch(world: int) -> None:
    results = run_ranks(world, _compare, timeout_s=120)
    for res in results:
        for key in ("allgather", "allgather_async", "reduce_scatter_sum", "reduce_scatter_max", "reduce_scatter_async"):
            mine, ref = res[key]
            torch.testing.assert_close(mine, ref, rtol=0, atol=0, msg=key)
        for key in ("coalesced_sync", "coalesced_async", "coalesced_same"):
            for mine, ref in res[key]:
                torch.testing.assert_close(mine, ref, rtol=0, atol=0, msg=key)
