"""Top-1, top-2 and top-k gating with expert capacity, as DeepSpeed-MoE (GShard / Switch) defines them.

Every function takes the router logits `[S, E]` (fp32) of this rank's S tokens and returns `Routes`: per
route r (the token's r-th choice) the expert index (-1 when capacity dropped it), its slot in that expert's
capacity buffer and its combine weight, plus the auxiliary load-balancing loss, the buffer capacity and the
tokens each expert was asked to take (before dropping).

Semantics kept from DeepSpeed 0.19.8, because checkpoints and loss curves must carry over:

- capacity `ceil(S / E * capacity_factor * k)`, at least `min_capacity` (k = 1 for top-1, 2 for top-2);
  without token dropping it is the largest per-expert count, agreed across the expert-parallel group (MAX),
  since every rank's dispatch buffer must have the same shape for the all-to-all.
- top-1 keeps, per expert, the `capacity` tokens with the highest score: a uniform random number with RTS
  (random token selection), else the 0/1 routing mask itself, so which tied tokens survive is whatever
  `torch.topk` picks (not token order); kept tokens take consecutive slots in token order.
  l_aux = E * sum_e(mean gate_e * fraction routed_e); gates are not renormalised.
- top-2's second choice is the best remaining logit, after Gumbel noise when `top2_2nd_expert_sampling`;
  all first choices are placed before any second choice, and a route past capacity is dropped by position.
  l_aux = E^2 * mean_e(mean gate_e * fraction first-routed_e); the kept gates are renormalised to sum 1.
- top-k (k > 2) keeps, per expert, the `capacity` routes with the largest gate ("probs" drop policy), or
  the first ones by position ("position"); l_aux = E^2 / k * mean_e(mean gate_e * fraction routed_e).
- `exp_counts` counts routes before capacity drops them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed import ProcessGroup

import ds_comm

__all__ = [
    "Routes",
    "capacity_for",
    "dense_combine",
    "gumbel_noise",
    "route_top1",
    "route_top2",
    "route_topk",
    "uniform_noise",
]


@dataclass
class Routes:
    """The gate's decision for S tokens, one row per route (a token's 1st, 2nd, ... choice).

    `indices`, `locations`: int64 `[k, S]`, the expert and the slot in its capacity buffer (-1 and 0 for a
    dropped route). `gates`: fp32 `[k, S]` combine weights (0 for a dropped route).
    """

    l_aux: Tensor
    capacity: int
    num_experts: int
    indices: Tensor
    locations: Tensor
    gates: Tensor
    exp_counts: Tensor


def uniform_noise(shape: torch.Size, device: torch.device, low: float = 0.0, high: float = 1.0) -> Tensor:
    """U(low, high) samples drawn from the global torch generator (as `torch.distributions.Uniform`)."""
    dist = torch.distributions.uniform.Uniform(
        torch.tensor(low, device=device), torch.tensor(high, device=device), validate_args=False
    )
    return dist.rsample(shape)


def gumbel_noise(shape: torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel samples from the global torch generator (the Gumbel-max trick's noise)."""
    dist = torch.distributions.gumbel.Gumbel(
        torch.tensor(0.0, device=device), torch.tensor(1.0, device=device), validate_args=False
    )
    return dist.rsample(shape)


def capacity_for(num_tokens: int, num_experts: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert: `ceil(tokens / experts * capacity_factor)`, at least `min_capacity`.

    Computed in fp32 as DeepSpeed does (its tensors), so borderline factors round the same way.
    """
    value = torch.ceil(torch.tensor(num_tokens / num_experts) * torch.tensor(float(capacity_factor)))
    return max(int(value.item()), int(min_capacity))


def _no_drop_capacity(exp_counts: Tensor, ep_group: ProcessGroup | None) -> int:
    """Without dropping: the largest per-expert count on any rank of the expert-parallel group."""
    cap = exp_counts.max().reshape(1).clone()
    if ep_group is not None and ds_comm.get_world_size(ep_group) > 1:
        ds_comm.all_reduce(cap, op=torch.distributed.ReduceOp.MAX, group=ep_group)
    return int(cap.item())


def _slot_of(mask: Tensor, locations: Tensor) -> Tensor:
    """Per token, the location at the (single) expert `mask` selects, 0 where it selects none."""
    return (locations * mask).sum(dim=1)


def route_top1(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    *,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: ProcessGroup | None = None,
) -> Routes:
    """Switch-style top-1 routing (see the module docstring).

    Raises:
        ValueError: fewer tokens than `min_capacity`.
    """
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    capacity = capacity_for(num_tokens, num_experts, capacity_factor, min_capacity)
    if noisy_gate_policy == "RSample":
        chooser = logits + gumbel_noise(logits.shape, logits.device)
    else:
        chooser = gates
    choice = torch.argmax(chooser, dim=1)
    mask = F.one_hot(choice, num_classes=num_experts)
    if used_token is not None:
        mask = mask * used_token.reshape(-1, 1).to(mask.dtype)
    exp_counts = mask.sum(dim=0).detach()
    if not drop_tokens:
        capacity = min(_no_drop_capacity(exp_counts, ep_group), num_tokens)

    routed_fraction = mask.float().mean(dim=0)
    l_aux = (gates.mean(dim=0) * routed_fraction).sum() * num_experts

    scores = mask * uniform_noise(mask.shape, logits.device) if use_rts else mask
    if num_tokens < min_capacity:
        raise ValueError(
            f"top-1 gating got {num_tokens} tokens, fewer than min_capacity={min_capacity}: set min_capacity "
            "to 0 or use a larger batch"
        )
    keep_rows = torch.topk(scores, k=min(capacity, num_tokens), dim=0)[1]
    mask = mask * torch.zeros_like(mask).scatter_(0, keep_rows, 1)
    locations = torch.cumsum(mask, dim=0) - 1
    kept = mask.sum(dim=1) > 0
    indices = torch.where(kept, choice, torch.full_like(choice, -1))
    gate_values = (gates * mask.float()).sum(dim=1)
    return Routes(
        l_aux=l_aux,
        capacity=capacity,
        num_experts=num_experts,
        indices=indices.unsqueeze(0),
        locations=_slot_of(mask, locations).unsqueeze(0),
        gates=gate_values.unsqueeze(0),
        exp_counts=exp_counts,
    )


def route_top2(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    *,
    drop_tokens: bool = True,
    ep_group: ProcessGroup | None = None,
    top2_2nd_expert_sampling: bool = True,
) -> Routes:
    """GShard-style top-2 routing (see the module docstring)."""
    num_tokens, num_experts = logits.shape
    gates = F.softmax(logits, dim=1)
    first = torch.argmax(gates, dim=1)
    mask1 = F.one_hot(first, num_classes=num_experts)
    chooser = logits
    if top2_2nd_expert_sampling:
        chooser = logits + gumbel_noise(logits.shape, logits.device)
    second = torch.argmax(chooser.masked_fill(mask1.bool(), float("-inf")), dim=1)
    mask2 = F.one_hot(second, num_classes=num_experts)

    locations1 = torch.cumsum(mask1, dim=0) - 1
    # Second choices queue behind every first choice of the same expert.
    locations2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)

    l_aux = (gates.mean(dim=0) * mask1.float().mean(dim=0)).mean() * num_experts * num_experts
    exp_counts = (mask1 + mask2).sum(dim=0).detach()

    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * 2, min_capacity)
        mask1 = mask1 * (locations1 < capacity)
        mask2 = mask2 * (locations2 < capacity)
    else:
        capacity = _no_drop_capacity(exp_counts, ep_group)

    gate1 = (gates * mask1.float()).sum(dim=1)
    gate2 = (gates * mask2.float()).sum(dim=1)
    denom = torch.clamp(gate1 + gate2, min=torch.finfo(gates.dtype).eps)
    kept1, kept2 = mask1.sum(dim=1) > 0, mask2.sum(dim=1) > 0
    return Routes(
        l_aux=l_aux,
        capacity=capacity,
        num_experts=num_experts,
        indices=torch.stack(
            [
                torch.where(kept1, first, torch.full_like(first, -1)),
                torch.where(kept2, second, torch.full_like(second, -1)),
            ]
        ),
        locations=torch.stack([_slot_of(mask1, locations1), _slot_of(mask2, locations2)]),
        gates=torch.stack([gate1 / denom, gate2 / denom]),
        exp_counts=exp_counts,
    )


def route_topk(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    *,
    drop_tokens: bool = True,
    ep_group: ProcessGroup | None = None,
    drop_policy: str = "probs",
) -> Routes:
    """Top-k routing for any k (see the module docstring).

    Raises:
        ValueError: `drop_policy` is not "probs" or "position", or k is not in [1, E].
    """
    num_tokens, num_experts = logits.shape
    if not 1 <= k <= num_experts:
        raise ValueError(f"top-k gating: k={k} must be between 1 and the number of experts ({num_experts})")
    if drop_policy not in ("probs", "position"):
        raise ValueError(f"top-k gating: drop_policy must be 'probs' or 'position', got {drop_policy!r}")
    gates = F.softmax(logits, dim=1)
    top_gate, top_idx = torch.topk(gates, k=k, dim=1)
    mask = torch.zeros_like(gates, dtype=torch.bool).scatter_(1, top_idx, True)
    exp_counts = mask.sum(dim=0).detach()
    l_aux = (gates.mean(dim=0) * mask.float().mean(dim=0)).mean() * num_experts * num_experts / k

    if drop_tokens:
        capacity = capacity_for(num_tokens, num_experts, capacity_factor * k, min_capacity)
        if drop_policy == "probs":
            by_gate = torch.zeros_like(gates).scatter(1, top_idx, top_gate)
            keep_rows = torch.topk(by_gate, k=min(capacity, num_tokens), dim=0, sorted=False)[1]
            mask = mask & torch.zeros_like(mask).scatter_(0, keep_rows, True)
            locations = torch.cumsum(mask, dim=0) - 1
        else:
            locations = torch.cumsum(mask, dim=0) - 1
            mask = mask & (locations < capacity)
    else:
        capacity = _no_drop_capacity(exp_counts, ep_group)
        locations = torch.cumsum(mask, dim=0) - 1

    kept_gates = gates * mask
    kept_gates = kept_gates / torch.clamp(kept_gates.sum(dim=-1, keepdim=True), min=torch.finfo(gates.dtype).eps)
    route_kept = mask.gather(1, top_idx)
    indices = torch.where(route_kept, top_idx, torch.full_like(top_idx, -1))
    route_locations = locations.gather(1, top_idx) * route_kept
    return Routes(
        l_aux=l_aux,
        capacity=capacity,
        num_experts=num_experts,
        indices=indices.t().contiguous(),
        locations=route_locations.t().contiguous(),
        gates=kept_gates.gather(1, top_idx).t().contiguous(),
        exp_counts=exp_counts,
    )


def dense_combine(routes: Routes) -> tuple[Tensor, Tensor]:
    """`(combine_weights [S, E, C], dispatch_mask)`: the einsum form of `routes` (GShard's tensors)."""
    k, num_tokens = routes.indices.shape
    combine = routes.gates.new_zeros(num_tokens, routes.num_experts, max(routes.capacity, 1))
    tokens = torch.arange(num_tokens, device=routes.indices.device)
    for r in range(k):
        kept = routes.indices[r] >= 0
        combine.index_put_(
            (tokens[kept], routes.indices[r][kept], routes.locations[r][kept]), routes.gates[r][kept], accumulate=True
        )
    combine = combine[..., : routes.capacity] if routes.capacity > 0 else combine[..., :0]
    return combine, combine.bool()
