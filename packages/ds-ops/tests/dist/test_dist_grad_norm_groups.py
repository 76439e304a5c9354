"""`grad_norm_groups`: per-group norms measured over the same layouts `finish_step` uses.

Two groups of gradients, partitioned over 2 ranks (each holds a different half), must give the norms of
the whole groups (torch.linalg.vector_norm on the concatenation), for p = 2, 1 and inf, without
changing the gradients; with a model-parallel group, replicated parts count once. The
stats form gives the same as the tensors it was measured on. Tolerance 1e-6 relative (fp32 sums).
"""

from __future__ import annotations

import math

import pytest
import torch

import ds_comm
from ds_comm.testing import run_ranks
from ds_ops.precision import GradStats, grad_norm_groups, local_norm_term

A = torch.linspace(-3.0, 5.0, 20)
B = torch.linspace(0.5, -2.0, 8)


def _expected(p: float) -> list[float]:
    return [float(torch.linalg.vector_norm(g, p)) for g in (A, B)]


def _partitioned(rank: int, world: int) -> dict[str, object]:
    mine = [[A.chunk(2)[rank].clone()], [B[:3].clone(), B[3:].clone()] if rank == 0 else [None]]
    before = [[t.clone() for t in g if t is not None] for g in mine]
    out: dict[str, object] = {}
    for p in (2.0, 1.0, math.inf):
        norms = grad_norm_groups(mine, norm_type=p)
        out[p] = [float(n) for n in norms]
        out[f"dims{p}"] = [n.dim() for n in norms]
    held = [[t for t in g if t is not None] for g in mine]
    out["unchanged"] = all(
        torch.equal(a, b) for g, h in zip(held, before, strict=True) for a, b in zip(g, h, strict=True)
    )
    stats = [GradStats(norm_term=float(local_norm_term(g)), nonfinite=False) for g in mine]
    out["stats"] = [float(n) for n in grad_norm_groups(stats=stats)]
    # one model-parallel group over both ranks: B is replicated (both hold it whole), A is cut in halves
    mp = ds_comm.new_group([0, 1])
    cut = A.chunk(2)[rank].clone()
    out["mp"] = [
        float(n)
        for n in grad_norm_groups(
            [[cut], [B.clone()]], partitioned=False, model_parallel_group=mp, model_parallel_grads=[[cut], []]
        )
    ]
    return out


def test_partitioned_groups_give_the_whole_groups_norms() -> None:
    for r in run_ranks(2, _partitioned, timeout_s=60):
        for p in (2.0, 1.0, math.inf):
            assert r[p] == pytest.approx(_expected(p), rel=1e-6), p
            assert r[f"dims{p}"] == [0, 0]
        assert r["unchanged"]
        assert r["stats"] == pytest.approx(_expected(2.0), rel=1e-6)
        assert r["mp"] == pytest.approx(_expected(2.0), rel=1e-6)


def test_single_process_and_bad_arguments() -> None:
    norms = grad_norm_groups([[A], [B[:4], None, torch.empty(0), B[4:]], []])
    assert [float(n) for n in norms] == pytest.approx([*_expected(2.0), 0.0], rel=1e-6)
    assert not math.isfinite(float(grad_norm_groups([[torch.tensor([1.0, math.inf])]])[0]))
    with pytest.raises(ValueError, match="exactly one of them"):
        grad_norm_groups([[A]], stats=[GradStats(norm_term=1.0, nonfinite=False)])
    with pytest.raises(ValueError, match="exactly one of them"):
        grad_norm_groups()
    with pytest.raises(ValueError, match="model_parallel_grads has 1 entries for 2 groups"):
        grad_norm_groups([[A], [B]], model_parallel_grads=[[A]])
