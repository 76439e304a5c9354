"""Folded dispatch in one process: assignment ordinals, the partition over TP lanes, the restore at one lane, and
`combine_from_routed`, each against a plain Python/PyTorch loop over the same assignments."""

from __future__ import annotations

import pytest
import torch

from ds_parallel.autoep import (
    RoutedAssignmentPayload,
    assignment_ordinals_by_expert,
    combine_from_routed,
    dispatch_counters,
    partition_assignments,
    restore_combined,
)


def routed_payload(num_tokens: int, num_experts: int, top_k: int, seed: int) -> tuple[RoutedAssignmentPayload, dict]:
    """A top-k routing of random scores, sorted by expert (as a layer builds it), one destination per expert."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_tokens, num_experts, generator=g).softmax(-1)
    top_scores, experts = scores.topk(top_k, dim=-1)
    order = torch.argsort(experts.flatten(), stable=True)
    expert_sorted = experts.flatten()[order]
    counts = torch.bincount(expert_sorted, minlength=num_experts).tolist()
    payload = RoutedAssignmentPayload(
        token_indices=order // top_k,
        expert_indices=expert_sorted,
        assignment_indices=assignment_ordinals_by_expert(expert_sorted),
        capacity_slots=order % top_k,
        combine_weights=top_scores.flatten()[order],
        drop_mask=torch.zeros(order.numel(), dtype=torch.bool),
        pad_mask=torch.zeros(order.numel(), dtype=torch.bool),
        input_splits=counts,
        output_splits=counts,
        extra={"destination_ranks": expert_sorted, "num_tokens": torch.tensor(num_tokens)},
    )
    return payload, {"top_scores": top_scores, "order": order}


def test_ordinals_count_within_each_run() -> None:
    experts = torch.tensor([1, 1, 1, 3, 5, 5, 0, 0])
    want, last, n = [], None, 0
    for e in experts.tolist():
        n = n + 1 if e == last else 0
        want.append(n)
        last = e
    assert assignment_ordinals_by_expert(experts).tolist() == want
    assert assignment_ordinals_by_expert(torch.empty(0, dtype=torch.long)).numel() == 0


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_lanes_split_the_active_assignments_exactly_once(tp: int) -> None:
    payload, _ = routed_payload(num_tokens=11, num_experts=4, top_k=2, seed=tp)
    payload.drop_mask[2] = True
    payload.pad_mask[5] = True
    active = set(torch.nonzero(~payload.drop_mask & ~payload.pad_mask).flatten().tolist())
    seen: list[int] = []
    split_sums = [0] * 4
    for lane in range(tp):
        local, ctx = partition_assignments(payload, tp_group=None, tp_rank=lane, tp_size=tp)
        seen += ctx.local_indices.tolist()
        assert local.input_splits == torch.bincount(local.expert_indices, minlength=4).tolist()
        split_sums = [a + b for a, b in zip(split_sums, local.input_splits, strict=True)]
        counters = dispatch_counters(ctx)
        assert (counters["assignments_total"], counters["dropped"], counters["padded"]) == (len(active), 1, 1)
    assert sorted(seen) == sorted(active)
    assert sum(split_sums) == len(active)


def test_restore_at_one_lane_is_the_weighted_sum_per_token() -> None:
    payload, _ = routed_payload(num_tokens=7, num_experts=3, top_k=2, seed=0)
    local, ctx = partition_assignments(payload, tp_group=None, tp_rank=0, tp_size=1)
    values = torch.randn(local.token_indices.numel(), 5, dtype=torch.float64)
    want = torch.zeros(7, 5, dtype=torch.float64)
    for row, token, weight in zip(values, local.token_indices.tolist(), local.combine_weights.tolist(), strict=True):
        want[token] += row * weight
    torch.testing.assert_close(restore_combined(values, ctx, tp_group=None), want)
    ctx.local_indices = ctx.local_indices[1:]
    with pytest.raises(RuntimeError, match="restore coverage mismatch: gathered 13 assignments, expected 14"):
        restore_combined(values[1:], ctx, tp_group=None, validate_coverage=True)


@pytest.mark.parametrize(("score_apply", "impl"), [("post", "weighted_sum"), ("post", "legacy_bmm"), ("pre", "-")])
def test_combine_from_routed_sums_each_tokens_choices(score_apply: str, impl: str) -> None:
    payload, extra = routed_payload(num_tokens=6, num_experts=4, top_k=2, seed=1)
    out_rows = torch.randn(12, 3)
    got = combine_from_routed(out_rows, extra["top_scores"], extra["order"], 2, score_apply, impl, (2, 3, 3))  # type: ignore[arg-type]
    want = torch.zeros(6, 3)
    for row, flat in zip(out_rows, extra["order"].tolist(), strict=True):
        token, slot = divmod(flat, 2)
        want[token] += row * (extra["top_scores"][token, slot] if score_apply == "post" else 1.0)
    torch.testing.assert_close(got, want.reshape(2, 3, 3), rtol=1e-6, atol=1e-6)
