"""Folded AutoEP+AutoTP dispatch: split the routed (token, expert) assignments over the TP lanes, and restore.

With folding, every TP lane of a group holds the same tokens and routes them identically. Sending every
assignment from every lane would carry each token `tp_size` times through the expert all-to-all, so each lane
keeps only the assignments whose ordinal within their expert's run is `tp_rank` modulo `tp_size`
(`partition_assignments`): the lanes together send each assignment exactly once. After the experts ran,
`restore_combined` all-gathers the lanes' outputs (variable row counts), weights them and sums them back per
token, adding one top-k slot at a time so the summation order is the token's own top-k order on every lane
(and equals the unpartitioned combine's). The gather is differentiable: its backward sums the replicated
output gradients over the group and keeps this lane's rows, which is the vector-Jacobian product of an
all-gather (each lane's loss may differ). `assert_tp_payload_consistent` checks the lanes really routed alike.

Collectives go through `ds_comm` (looked up at call time) on the given TP group.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

import ds_comm

__all__ = [
    "RestoreContext",
    "RoutedAssignmentPayload",
    "assert_tp_payload_consistent",
    "assignment_ordinals_by_expert",
    "dispatch_counters",
    "partition_assignments",
    "restore_combined",
]

logger = logging.getLogger(__name__)

_PRIMES = (2_147_483_647, 2_147_483_629)  # two moduli: a divergence must fool both to go unseen


@dataclasses.dataclass
class RoutedAssignmentPayload:
    """One row per routed (token, expert) assignment, sorted by expert, plus the exchange's split sizes.

    `extra["destination_ranks"]` (per row) lets the splits be recounted after partitioning;
    `extra["num_tokens"]` is the token count the restore writes into.
    """

    token_indices: torch.Tensor
    expert_indices: torch.Tensor
    assignment_indices: torch.Tensor
    """Ordinal of the row within its expert's run (see `assignment_ordinals_by_expert`)."""
    capacity_slots: torch.Tensor
    """The row's top-k slot (or capacity slot); the restore adds slots in increasing order."""
    combine_weights: torch.Tensor
    drop_mask: torch.Tensor
    pad_mask: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]
    extra: dict[str, Any]


@dataclasses.dataclass
class RestoreContext:
    """What `restore_combined` needs: the full payload and which of its rows this lane kept."""

    original_payload: RoutedAssignmentPayload
    local_indices: torch.Tensor
    tp_rank: int
    tp_size: int
    num_tokens: int
    counters: dict[str, int]


def assignment_ordinals_by_expert(expert_indices: torch.Tensor) -> torch.Tensor:
    """For expert-sorted rows, each row's position within its run of equal experts (`[0,0,2,2,2] -> [0,1,0,1,2]`)."""
    n = expert_indices.numel()
    position = torch.arange(n, device=expert_indices.device, dtype=torch.long)
    if n == 0:
        return position
    starts = torch.ones(n, dtype=torch.bool, device=expert_indices.device)
    starts[1:] = expert_indices[1:] != expert_indices[:-1]
    run_start = torch.cummax(torch.where(starts, position, torch.zeros_like(position)), dim=0).values
    return position - run_start


def _rows(payload: RoutedAssignmentPayload, keep: torch.Tensor) -> RoutedAssignmentPayload:
    n = payload.token_indices.shape[0]

    def take(t: Any) -> Any:
        return t.index_select(0, keep) if torch.is_tensor(t) and t.dim() > 0 and t.shape[0] == n else t

    fields = {f.name: take(getattr(payload, f.name)) for f in dataclasses.fields(payload) if f.name != "extra"}
    return RoutedAssignmentPayload(**fields | {"extra": {k: take(v) for k, v in payload.extra.items()}})


def _num_tokens(payload: RoutedAssignmentPayload) -> int:
    value = payload.extra.get("num_tokens", 0)
    return int(value.item()) if torch.is_tensor(value) else int(value)


def partition_assignments(
    payload: RoutedAssignmentPayload, *, tp_group: Any, tp_rank: int, tp_size: int
) -> tuple[RoutedAssignmentPayload, RestoreContext]:
    """Keep this lane's share of the active (not dropped, not padded) assignments; recount the send splits.

    Issues no collective (`tp_group` is kept for the caller's symmetry with `restore_combined`).
    """
    del tp_group
    active = ~payload.drop_mask & ~payload.pad_mask
    keep = active if tp_size <= 1 else active & (payload.assignment_indices.remainder(tp_size) == tp_rank)
    local_indices = keep.nonzero().flatten()
    local = _rows(payload, local_indices)
    destinations = local.extra.get("destination_ranks")
    if destinations is not None and payload.input_splits:
        num_dest = len(payload.input_splits)
        local.input_splits = torch.bincount(destinations.long(), minlength=num_dest)[:num_dest].tolist()
    local.output_splits = list(local.input_splits)
    counters = {
        "assignments_total": int(active.sum()),
        "assignments_local": int(local_indices.numel()),
        "padded": int(payload.pad_mask.sum()),
        "dropped": int(payload.drop_mask.sum()),
        "split_sum_in": sum(local.input_splits),
        "split_sum_out": sum(local.output_splits),
    }
    ctx = RestoreContext(payload, local_indices, tp_rank, tp_size, _num_tokens(payload), counters)
    return local, ctx


def dispatch_counters(ctx: RestoreContext) -> dict[str, int]:
    """A copy of the partition's counts (total/local assignments, padded, dropped, split sums)."""
    return dict(ctx.counters)


def _digest(payload: RoutedAssignmentPayload) -> torch.Tensor:
    """`[rows, sum(in splits), sum(out splits), hash mod p1, hash mod p2]` over every routing field."""
    device = payload.token_indices.device
    out = torch.tensor(
        [payload.token_indices.numel(), sum(payload.input_splits), sum(payload.output_splits), 0, 0],
        dtype=torch.long,
        device=device,
    )
    fields = [payload.token_indices, payload.expert_indices, payload.assignment_indices, payload.capacity_slots]
    fields += [payload.combine_weights, payload.drop_mask, payload.pad_mask]
    dest = payload.extra.get("destination_ranks")
    fields += [dest] if torch.is_tensor(dest) else []
    for salt, field in enumerate(fields, start=1):
        field = field.detach()
        words = (field.float().nan_to_num().mul(1e6).round() if field.is_floating_point() else field).long().flatten()
        for i, prime in enumerate(_PRIMES):
            weight = torch.arange(1, words.numel() + 1, device=device).add(salt * (i + 7)).remainder(prime)
            out[3 + i] = (out[3 + i] + (words.remainder(prime) * weight).remainder(prime).sum()).remainder(prime)
    return out


def assert_tp_payload_consistent(payload: RoutedAssignmentPayload, *, tp_group: Any, tp_size: int) -> None:
    """Raise when the TP lanes' routing payloads differ (two `all_reduce`s, MAX and MIN, of a 5-word digest on
    `tp_group`); no-op for one lane or without a process group.

    Raises:
        RuntimeError: the lanes routed differently (folded dispatch needs identical routing on every lane).
    """
    if tp_size <= 1 or not ds_comm.is_initialized():
        return
    spread = digest_spread(_digest(payload), tp_group)
    if spread is not None:
        raise RuntimeError(
            "AutoEP+AutoTP routing decisions differ across tensor-parallel lanes (payload digests "
            f"{spread[0]} .. {spread[1]}); folded dispatch needs identical routing on every lane"
        )


def digest_spread(digest: torch.Tensor, group: Any) -> tuple[list[Any], list[Any]] | None:
    """None when every rank of `group` holds the same `digest`; else its element-wise (min, max) over the group,
    for the error message. Two all-reduces, the same on every rank, so every rank reaches the same verdict."""
    high, low = digest.clone(), digest.clone()
    ds_comm.all_reduce(high, op=ds_comm.ReduceOp.MAX, group=group)
    ds_comm.all_reduce(low, op=ds_comm.ReduceOp.MIN, group=group)
    return None if torch.equal(high, low) else (low.tolist(), high.tolist())


def _gather_counts(rows: int, group: Any, size: int, device: torch.device) -> list[int]:
    mine = torch.tensor([rows], dtype=torch.long, device=device)
    counts = [torch.zeros_like(mine) for _ in range(size)]
    ds_comm.all_gather(counts, mine, group=group)
    return [int(c) for c in counts]


def gather_rows(x: torch.Tensor, group: Any, counts: list[int]) -> torch.Tensor:
    """Every rank's rows of `x`, rank by rank (rank r gives `counts[r]` rows): padded to the longest, all-gathered,
    trimmed back. Not differentiable by itself; the autograd functions around it decide the backward."""
    longest = max(counts)
    padded = torch.cat([x, x.new_zeros((longest - x.shape[0], *x.shape[1:]))]) if x.shape[0] < longest else x
    parts = [torch.empty_like(padded) for _ in counts]
    ds_comm.all_gather(parts, padded.contiguous(), group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])


class _GatherRows(torch.autograd.Function):
    """All-gather of variable row counts; backward: sum the output gradient over the group, keep own rows."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, counts: tuple[int, ...], rank: int) -> torch.Tensor:
        ctx.group, ctx.counts, ctx.rank = group, counts, rank
        return gather_rows(x, group, list(counts))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        total = grad.contiguous().clone()
        ds_comm.all_reduce(total, group=ctx.group)
        start = sum(ctx.counts[: ctx.rank])
        return total[start : start + ctx.counts[ctx.rank]], None, None, None


def _gather(x: torch.Tensor, group: Any, counts: list[int], rank: int) -> torch.Tensor:
    if x.requires_grad:
        out: torch.Tensor = _GatherRows.apply(x, group, tuple(counts), rank)
        return out
    return gather_rows(x, group, counts)


def _check_coverage(payload: RoutedAssignmentPayload, gathered: list[torch.Tensor]) -> None:
    active = ~payload.drop_mask & ~payload.pad_mask
    want = [payload.token_indices, payload.expert_indices, payload.assignment_indices, payload.capacity_slots]
    expected = torch.stack([t[active].long() for t in want], dim=1)
    seen = torch.stack([t.long() for t in gathered], dim=1)
    if seen.shape[0] != expected.shape[0] or set(map(tuple, seen.tolist())) != set(map(tuple, expected.tolist())):
        missing = sorted(set(map(tuple, expected.tolist())) - set(map(tuple, seen.tolist())))[:5]
        raise RuntimeError(
            f"AutoEP+AutoTP restore coverage mismatch: gathered {seen.shape[0]} assignments, expected "
            f"{expected.shape[0]}; missing (token, expert, ordinal, slot) e.g. {missing}"
        )


def restore_combined(
    local_combined: torch.Tensor, ctx: RestoreContext, *, tp_group: Any, validate_coverage: bool = False
) -> torch.Tensor:
    """`[num_tokens, H]`: every lane's expert outputs (`local_combined`, one row per kept assignment), weighted by
    their combine weights and summed per token in top-k slot order; identical on every lane.

    Collectives on `tp_group` when `ctx.tp_size` > 1: one all_gather of row counts and one per gathered field
    (outputs, tokens, slots, weights; expert and ordinal too with `validate_coverage`); backward: one all_reduce
    per differentiable field.

    Raises:
        RuntimeError: with `validate_coverage`, the lanes' rows together are not exactly the active assignments.
    """
    payload = ctx.original_payload
    picked = [
        payload.token_indices.index_select(0, ctx.local_indices),
        payload.capacity_slots.index_select(0, ctx.local_indices),
        payload.combine_weights.index_select(0, ctx.local_indices).to(local_combined.dtype),
    ]
    if validate_coverage:
        picked += [t.index_select(0, ctx.local_indices) for t in (payload.expert_indices, payload.assignment_indices)]
    if ctx.tp_size > 1 and ds_comm.is_initialized():
        rank = ds_comm.get_rank(group=tp_group)
        counts = _gather_counts(local_combined.shape[0], tp_group, ctx.tp_size, local_combined.device)
        outputs = _gather(local_combined, tp_group, counts, rank)
        picked = [_gather(t, tp_group, counts, rank) for t in picked]
    else:
        outputs = local_combined
    tokens, slots, weights = picked[0].long(), picked[1].long(), picked[2]
    if validate_coverage:
        _check_coverage(payload, [tokens, picked[3], picked[4], slots])
    if ctx.num_tokens <= 0:
        ctx.num_tokens = int(payload.token_indices.max()) + 1 if payload.token_indices.numel() else 0
    out = local_combined.new_zeros((ctx.num_tokens, *local_combined.shape[1:]))
    weighted = outputs * weights.reshape(-1, *([1] * (outputs.dim() - 1)))
    for slot in torch.unique(slots, sorted=True).tolist():  # one slot at a time: the token's own top-k order
        rows = slots == slot
        out = out.index_add(0, tokens[rows], weighted[rows])
    return out
