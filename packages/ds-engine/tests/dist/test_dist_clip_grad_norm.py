"""`deepspeed.runtime.utils.clip_grad_norm_` on 2 ranks: the norm is averaged over the data-parallel group.

DeepSpeed 0.19.8 averages each rank's gradient norm over the data-parallel ranks (MoE expert gradients
differ per rank) and clips every rank's gradients with that one coefficient.
"""

from __future__ import annotations

from typing import Any

import torch

from ds_comm.testing import run_ranks


def _clip(rank: int, world: int) -> dict[str, Any]:
    from ds_engine.runtime.utils import clip_grad_norm_

    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    params = [torch.nn.Parameter(torch.zeros_like(t)) for t in grads]
    for p, t in zip(params, grads, strict=True):
        p.grad = t * (rank + 1)  # rank 1's gradients are twice rank 0's
    norm = clip_grad_norm_(params, max_norm=1.0)
    local = torch.sqrt(sum(t.pow(2).sum() for t in grads))
    return {"norm": norm, "local": local, "grads": [p.grad for p in params], "raw": grads}


def test_norm_is_the_mean_over_ranks_and_one_coefficient_clips_all() -> None:
    results = run_ranks(2, _clip, timeout_s=60)
    local = results[0]["local"]
    expected = (local * 1 + local * 2) / 2
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["norm"], expected)
        coef = min(1.0, 1.0 / (expected.item() + 1e-6))
        for got, raw in zip(r["grads"], r["raw"], strict=True):
            torch.testing.assert_close(got, raw * (rank + 1) * coef)
