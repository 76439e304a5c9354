"""Splitting a sequence of layers into contiguous parts: uniform by count, or balanced by weight.

Both return part boundaries: a list `parts` of length `num_parts + 1` with `parts[0] == 0` and
`parts[-1] == num_items`; part `p` holds items `parts[p]:parts[p + 1]`.

[Note: balanced objective] A pipeline runs at the pace of its heaviest stage, so
`partition_balanced` first minimises the heaviest part (the bottleneck). Many splits usually share
that bottleneck; among them it picks the one with the smallest sum of squared part weights, the
most even one (e.g. weights `[1]*9 + [10]` in 3 parts gives `[5, 4, 10]`, not `[8, 1, 10]`);
remaining ties go to the latest split point.
Both criteria are solved exactly: the bottleneck by a search over the candidate part sums with a
greedy feasibility test, the tie-break by dynamic programming vectorised with torch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

logger = logging.getLogger(__name__)

__all__ = ["partition_balanced", "partition_uniform", "prefix_sum_inc"]


def _check_counts(num_items: int, num_parts: int, where: str) -> None:
    if isinstance(num_parts, bool) or not isinstance(num_parts, int) or num_parts < 1:
        raise ValueError(f"{where}: num_parts must be an int >= 1, got {num_parts!r}")
    if isinstance(num_items, bool) or not isinstance(num_items, int) or num_items < 0:
        raise ValueError(f"{where}: num_items must be an int >= 0, got {num_items!r}")


def prefix_sum_inc(weights: Sequence[float]) -> list[float]:
    """Inclusive prefix sums: `[w0, w0 + w1, ...]`."""
    out: list[float] = []
    total: float = 0
    for w in weights:
        total += w
        out.append(total)
    return out


def partition_uniform(num_items: int, num_parts: int) -> list[int]:
    """Boundaries of `num_parts` parts whose sizes differ by at most one; the first parts get the extras.

    With fewer items than parts, the first `num_items` parts hold one item each and the rest are empty.
    Example: `partition_uniform(10, 4) == [0, 3, 6, 8, 10]`.

    Raises:
        ValueError: `num_parts < 1` or `num_items < 0`.
    """
    _check_counts(num_items, num_parts, "partition_uniform")
    base, extra = divmod(num_items, num_parts)
    parts = [0]
    for p in range(num_parts):
        parts.append(parts[-1] + base + (1 if p < extra else 0))
    return parts


def _fits(weights: Sequence[float], num_parts: int, cap: float) -> bool:
    """Whether a left-to-right greedy packing with parts of weight <= cap uses at most num_parts parts."""
    used, current = 1, 0.0
    for w in weights:
        if w > cap:
            return False
        if current + w > cap:
            used += 1
            current = 0.0
        current += w
    return used <= num_parts


def _min_bottleneck(weights: Sequence[float], num_parts: int) -> float:
    """The smallest achievable heaviest-part weight (exact: it is one of the contiguous sums)."""
    prefix = [0.0, *prefix_sum_inc(weights)]
    n = len(weights)
    lower = max(weights)
    candidates = sorted(
        {prefix[j] - prefix[i] for i in range(n) for j in range(i + 1, n + 1) if prefix[j] - prefix[i] >= lower}
    )
    lo, hi = 0, len(candidates) - 1
    while lo < hi:
        mid = (lo + hi) // 2
        if _fits(weights, num_parts, candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    return candidates[lo]


def partition_balanced(weights: Sequence[float], num_parts: int) -> list[int]:
    """Boundaries of `num_parts` contiguous, non-empty parts with the lightest possible heaviest part.

    Ties are broken by the smallest sum of squared part weights (see the module note). With no more
    items than parts, or all weights zero, it falls back to `partition_uniform(len(weights), num_parts)`.

    Args:
        weights: a non-negative weight per item (e.g. trainable parameters per layer).
        num_parts: number of parts (pipeline stages), >= 1.

    Raises:
        ValueError: `num_parts < 1` or a weight is negative.
    """
    weights = [float(w) for w in weights]
    n = len(weights)
    _check_counts(n, num_parts, "partition_balanced")
    negative = [i for i, w in enumerate(weights) if w < 0]
    if negative:
        raise ValueError(f"partition_balanced: weights must be >= 0; item {negative[0]} has {weights[negative[0]]}")
    if n <= num_parts or sum(weights) == 0:
        return partition_uniform(n, num_parts)
    cap = _min_bottleneck(weights, num_parts)
    # cost[i] = least sum of squares splitting items [0, i) into j parts of weight <= cap (inf if impossible).
    prefix = torch.tensor([0.0, *prefix_sum_inc(weights)], dtype=torch.float64)
    seg = prefix.unsqueeze(0) - prefix.unsqueeze(1)  # seg[k, i] = weight of items [k, i)
    idx = torch.arange(n + 1)
    allowed = (idx.unsqueeze(0) > idx.unsqueeze(1)) & (seg <= cap * (1 + 1e-12))
    inf = torch.tensor(float("inf"), dtype=torch.float64)
    square = torch.where(allowed, seg * seg, inf)
    cost = torch.full((n + 1,), float("inf"), dtype=torch.float64)
    cost[0] = 0.0
    choices = []
    for _ in range(num_parts):
        total = cost.unsqueeze(1) + square  # total[k, i]: best for [0, k) then part [k, i)
        # On ties prefer the latest split point, so zero-weight layers (activations, norms without
        # parameters) stay with the layer before them: [10, 0, 10, 0] -> [10, 0 | 10, 0].
        cost, flipped_k = total.flip(0).min(dim=0)
        choices.append(n - flipped_k)
    assert torch.isfinite(cost[n]), "a partition within the bottleneck must exist"
    parts = [n]
    for best_k in reversed(choices):
        parts.append(int(best_k[parts[-1]]))
    parts.reverse()
    assert parts[0] == 0, parts
    return parts
