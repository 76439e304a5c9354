"""Moving tokens into the experts' capacity buffers and their results back, from `Routes`.

A kept route (token s -> expert e, slot c) owns row `e * C + c` of the `[E * C, M]` buffer; dropped routes
point at one extra scratch row that is cut off, so both directions are a single `index_select` and need no
branches. Every slot holds at most one route, so the encode is a gather (each slot names its source token,
empty slots read a zero row) and its backward is the matching scatter-add that autograd derives.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ds_parallel.moe._gating import Routes

__all__ = ["combine", "dispatch", "route_slots", "slots_of"]


def route_slots(routes: Routes) -> Tensor:
    """`[k, S]` row of each route in the flat `[E * C (+1 scratch), M]` buffer."""
    return slots_of(routes.indices, routes.locations, routes.num_experts, routes.capacity)


def slots_of(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """`route_slots` from the routes' expert indices and locations (`[k, S]` each, or sequences of `[S]`)."""
    if not isinstance(indices, Tensor):
        indices, locations = torch.stack(list(indices)), torch.stack(list(locations))
    scratch = num_experts * capacity
    slot = indices.long() * capacity + locations.long()
    return torch.where(indices >= 0, slot, torch.full_like(slot, scratch))


def dispatch(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """`[E, C, M]`: each expert's slots filled with the tokens routed there (zeros where none is)."""
    num_tokens, model_dim = tokens.shape
    source = torch.full((num_experts * capacity + 1,), num_tokens, dtype=torch.long, device=tokens.device)
    token_ids = torch.arange(num_tokens, device=tokens.device).expand_as(slots)
    source.scatter_(0, slots.reshape(-1), token_ids.reshape(-1))
    padded = torch.cat([tokens, tokens.new_zeros(1, model_dim)])
    return padded.index_select(0, source[:-1]).view(num_experts, capacity, model_dim)


def combine(expert_output: Tensor, slots: Tensor, gates: Tensor) -> Tensor:
    """`[S, M]`: per token, the sum over its routes of gate x the expert's output in the route's slot.

    The weighting and the sum run in fp32 (the gates' dtype); the result takes the experts' dtype.
    """
    model_dim = expert_output.shape[-1]
    flat = expert_output.reshape(-1, model_dim)
    padded = torch.cat([flat, flat.new_zeros(1, model_dim)])
    k, num_tokens = slots.shape
    picked = padded.index_select(0, slots.reshape(-1)).view(k, num_tokens, model_dim)
    return (picked * gates.unsqueeze(-1)).sum(dim=0).to(expert_output.dtype)
