"""Gating against a reference written out token by token in this file: capacity, drops, slots, gates, l_aux,
exp_counts, for top-1 (RTS seeded, RTS off, no drop, used_token), top-2 (sampling off) and top-3."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ds_parallel.moe._gating import route_top1, route_top2, route_topk

S, E = 24, 4


def _logits(seed: int, skew: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(S, E, generator=g)
    if skew:  # crowd expert 0 so capacity bites
        logits[:, 0] += 1.5
    return logits


def _cap(tokens: int, factor: float, min_capacity: int) -> int:
    return max(math.ceil(tokens / E * factor), min_capacity)


def _routes_as_dict(routes, r: int) -> dict[int, tuple[int, int, float]]:
    """token -> (expert, slot, gate) of route r, kept routes only."""
    out = {}
    for s in range(routes.indices.shape[1]):
        e = int(routes.indices[r, s])
        if e >= 0:
            out[s] = (e, int(routes.locations[r, s]), float(routes.gates[r, s]))
    return out


def _check_slots_are_token_ordered(kept: dict[int, tuple[int, int, float]], capacity: int) -> None:
    by_expert: dict[int, list[tuple[int, int]]] = {}
    for s, (e, slot, _) in kept.items():
        by_expert.setdefault(e, []).append((s, slot))
    for e, pairs in by_expert.items():
        pairs.sort()
        assert [slot for _, slot in pairs] == list(range(len(pairs))), (e, pairs)
        assert len(pairs) <= capacity


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_top1_with_rts_keeps_the_highest_random_scores(factor: float) -> None:
    logits = _logits(0)
    torch.manual_seed(7)
    routes = route_top1(logits, factor, 2, use_rts=True)
    torch.manual_seed(7)
    scores = torch.rand(S, E)  # the RTS draw the gate makes with the same seed

    probs = F.softmax(logits, dim=1)
    choice = [int(torch.argmax(probs[s])) for s in range(S)]
    capacity = _cap(S, factor, 2)
    kept_tokens = set()
    for e in range(E):
        mine = [s for s in range(S) if choice[s] == e]
        mine.sort(key=lambda s: -float(scores[s, e]))
        kept_tokens |= set(mine[:capacity])
    expected = {}
    for e in range(E):
        for slot, s in enumerate(sorted(t for t in kept_tokens if choice[t] == e)):
            expected[s] = (e, slot, float(probs[s, e]))

    assert routes.capacity == capacity
    got = _routes_as_dict(routes, 0)
    assert got.keys() == expected.keys()
    for s in expected:
        assert got[s][:2] == expected[s][:2]
        assert got[s][2] == pytest.approx(expected[s][2], abs=1e-7)
    counts = [choice.count(e) for e in range(E)]
    assert routes.exp_counts.tolist() == counts
    l_aux = sum(float(probs[:, e].mean()) * counts[e] / S for e in range(E)) * E
    assert float(routes.l_aux) == pytest.approx(l_aux, abs=1e-6)
    if factor == 0.5:
        assert len(expected) < S  # the skew makes capacity drop tokens


def test_top1_without_rts_drops_to_capacity_in_slot_order() -> None:
    logits = _logits(1)
    routes = route_top1(logits, 0.5, 1, use_rts=False)
    choice = torch.argmax(logits, dim=1).tolist()
    capacity = _cap(S, 0.5, 1)
    got = _routes_as_dict(routes, 0)
    for e in range(E):
        kept = [s for s, v in got.items() if v[0] == e]
        assert len(kept) == min(choice.count(e), capacity)
        assert all(choice[s] == e for s in kept)
    _check_slots_are_token_ordered(got, capacity)


def test_top1_no_drop_keeps_everything_and_sizes_capacity_to_the_busiest_expert() -> None:
    logits = _logits(2)
    routes = route_top1(logits, 0.25, 1, drop_tokens=False, use_rts=False)
    choice = torch.argmax(logits, dim=1).tolist()
    assert routes.capacity == max(choice.count(e) for e in range(E))
    got = _routes_as_dict(routes, 0)
    assert sorted(got) == list(range(S))
    _check_slots_are_token_ordered(got, routes.capacity)


def test_top1_used_token_masks_tokens_out_of_routing_and_counts() -> None:
    logits = _logits(3, skew=False)
    used = torch.ones(S)
    used[::3] = 0
    routes = route_top1(logits, 4.0, 1, used_token=used, use_rts=False)
    choice = torch.argmax(logits, dim=1).tolist()
    got = _routes_as_dict(routes, 0)
    assert sorted(got) == [s for s in range(S) if used[s]]
    assert routes.exp_counts.tolist() == [sum(1 for s in range(S) if used[s] and choice[s] == e) for e in range(E)]


def test_top1_refuses_fewer_tokens_than_min_capacity() -> None:
    with pytest.raises(ValueError, match="min_capacity=32"):
        route_top1(_logits(0), 1.0, 32)


@pytest.mark.parametrize("drop", [True, False])
def test_top2_without_sampling(drop: bool) -> None:
    logits = _logits(4)
    routes = route_top2(logits, 0.5, 1, drop_tokens=drop, top2_2nd_expert_sampling=False)
    probs = F.softmax(logits, dim=1)
    first = [int(torch.argmax(probs[s])) for s in range(S)]
    second = [max((e for e in range(E) if e != first[s]), key=lambda e: float(logits[s, e])) for s in range(S)]
    counts = [first.count(e) + second.count(e) for e in range(E)]
    capacity = _cap(S, 1.0, 1) if drop else max(counts)
    # First choices fill slots in token order; second choices queue behind all first choices.
    slot1, slot2, used = {}, {}, dict.fromkeys(range(E), 0)
    for s in range(S):
        slot1[s] = used[first[s]]
        used[first[s]] += 1
    for s in range(S):
        slot2[s] = used[second[s]]
        used[second[s]] += 1
    assert routes.capacity == capacity
    assert routes.exp_counts.tolist() == counts
    got1, got2 = _routes_as_dict(routes, 0), _routes_as_dict(routes, 1)
    for s in range(S):
        keep1, keep2 = slot1[s] < capacity, slot2[s] < capacity
        g1 = float(probs[s, first[s]]) if keep1 else 0.0
        g2 = float(probs[s, second[s]]) if keep2 else 0.0
        denom = max(g1 + g2, torch.finfo(torch.float32).eps)
        assert (s in got1) == keep1 and (s in got2) == keep2
        if keep1:
            assert got1[s][:2] == (first[s], slot1[s]) and got1[s][2] == pytest.approx(g1 / denom, abs=1e-6)
        if keep2:
            assert got2[s][:2] == (second[s], slot2[s]) and got2[s][2] == pytest.approx(g2 / denom, abs=1e-6)
    l_aux = sum(float(probs[:, e].mean()) * first.count(e) / S for e in range(E)) / E * E * E
    assert float(routes.l_aux) == pytest.approx(l_aux, abs=1e-6)
    if drop:
        assert len(got1) + len(got2) < 2 * S


def test_top3_drops_the_smallest_gates_per_expert() -> None:
    logits = _logits(5)
    k, factor = 3, 0.5
    routes = route_topk(logits, k, factor, 1)
    probs = F.softmax(logits, dim=1)
    chosen = [sorted(range(E), key=lambda e: -float(probs[s, e]))[:k] for s in range(S)]
    capacity = _cap(S, factor * k, 1)
    keep = set()
    for e in range(E):
        mine = sorted((s for s in range(S) if e in chosen[s]), key=lambda s: -float(probs[s, e]))
        keep |= {(s, e) for s in mine[:capacity]}
    assert routes.capacity == capacity
    assert routes.exp_counts.tolist() == [sum(e in c for c in chosen) for e in range(E)]
    for s in range(S):
        total = sum(float(probs[s, e]) for e in chosen[s] if (s, e) in keep)
        for r in range(k):
            e = int(routes.indices[r, s])
            assert e == (chosen[s][r] if (s, chosen[s][r]) in keep else -1)
            if e >= 0:
                slot = sorted(t for t in range(S) if (t, e) in keep).index(s)
                assert int(routes.locations[r, s]) == slot
                assert float(routes.gates[r, s]) == pytest.approx(float(probs[s, e]) / total, abs=1e-6)
    ce = [sum(e in c for c in chosen) / S for e in range(E)]
    l_aux = sum(float(probs[:, e].mean()) * ce[e] for e in range(E)) / E * E * E / k
    assert float(routes.l_aux) == pytest.approx(l_aux, abs=1e-6)


def test_topk_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="drop_policy"):
        route_topk(_logits(0), 3, 1.0, 1, drop_policy="random")
    with pytest.raises(ValueError, match="k=5"):
        route_topk(_logits(0), 5, 1.0, 1)
