"""DeepSpeed's sparse-route helpers of `sharded_moe` (`_route_slots`, `_sparse_encode`, `_sparse_decode`) against
the dense GShard einsums on the same gate output, and `MOELayer`'s exchange going through `_AllToAll.apply`."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ds_parallel.moe import sharded_moe
from ds_parallel.moe.sharded_moe import (
    _route_slots,
    _sparse_decode,
    _sparse_encode,
    top1gating,
    top2gating,
    topkgating,
)

S, E, M = 20, 4, 6


def _gate(k: int, sparse: bool, logits: torch.Tensor) -> tuple:
    if k == 1:
        return top1gating(logits, 1.0, 0, use_rts=False, sparse_routes=sparse)
    if k == 2:
        return top2gating(logits, 1.0, 0, top2_2nd_expert_sampling=False, sparse_routes=sparse)
    return topkgating(logits, k, 1.0, 0, sparse_routes=sparse)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_sparse_encode_and_decode_equal_the_dense_einsums(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(S, E, generator=g)
    logits[:, 0] += 1.0  # crowd expert 0 so some routes are dropped
    tokens = torch.randn(S, M, generator=g)
    _, combine_weights, dispatch_mask, _ = _gate(k, False, logits)
    _, capacity, num_experts, indices, locations, gates, _ = _gate(k, True, logits)
    assert bool((indices < 0).any())  # the case covers dropped routes
    slots = _route_slots(indices, locations, num_experts, capacity)
    assert slots.shape == (k, S)

    encoded = _sparse_encode(tokens, slots, num_experts, capacity)
    torch.testing.assert_close(encoded, torch.einsum("sec,sm->ecm", dispatch_mask.float(), tokens))

    expert_out = torch.randn(num_experts, capacity, M, generator=g)
    decoded = _sparse_decode(expert_out.view(num_experts * capacity, M), slots, gates, S)
    torch.testing.assert_close(decoded, torch.einsum("sec,ecm->sm", combine_weights, expert_out))


def test_route_slots_accepts_per_route_sequences_and_decode_checks_the_token_count() -> None:
    logits = torch.randn(S, E, generator=torch.Generator().manual_seed(5))
    _, capacity, num_experts, indices, locations, gates, _ = _gate(2, True, logits)
    as_lists = _route_slots(list(indices), list(locations), num_experts, capacity)
    assert torch.equal(as_lists, _route_slots(indices, locations, num_experts, capacity))
    with pytest.raises(ValueError, match="num_tokens=3"):
        _sparse_decode(torch.zeros(num_experts * capacity, M), as_lists, gates, 3)


def test_the_layer_exchanges_through_all_to_all_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    """With ep_size 2 the forward makes two exchanges (tokens out, results back), each `_AllToAll.apply(group, x)`;
    replaced by the identity here (one process), so what the layer sends is visible."""
    from ds_parallel.moe import MoE

    torch.manual_seed(0)
    layer = MoE(M, nn.Linear(M, M), num_experts=4, ep_size=2, k=1, min_capacity=0)
    sentinel = object()
    layer.deepspeed_moe._set_ep_group(sentinel)
    calls: list[tuple[object, tuple[int, ...]]] = []

    def identity(group: object, x: torch.Tensor) -> torch.Tensor:
        calls.append((group, tuple(x.shape)))
        return x

    monkeypatch.setattr(sharded_moe._AllToAll, "apply", identity)
    out, _, _ = layer(torch.randn(1, 8, M))
    assert out.shape == (1, 8, M)
    assert [g for g, _ in calls] == [sentinel, sentinel]
    assert calls[0][1][0] == 4  # the [E, C, M] buffer: both ranks' experts
