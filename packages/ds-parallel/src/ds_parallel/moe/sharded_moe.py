"""`TopKGate` and `MOELayer` (DeepSpeed's `deepspeed.moe.sharded_moe`): routing and expert-parallel dispatch.

`MOELayer.forward` on this rank's tokens `[..., M]`:

1. the gate routes each of the S tokens to k experts (`ds_parallel.moe._gating`), fixing the capacity C;
2. tokens are copied into the `[E, C, M]` capacity buffer (`_dispatch.dispatch`);
3. with `ep_size > 1` an all-to-all over the expert-parallel group gives each rank, for its E/ep local
   experts, the slots every rank filled: `[ep, E/ep, C, M]`;
4. the local experts run (`Experts`), the results go back by the reverse all-to-all, and each token's
   output is the gate-weighted sum of its routes' results (dropped routes contribute nothing).

`l_aux` and `exp_counts` of the last forward stay on the layer (`MoE.forward` returns them).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import Tensor, nn

import ds_comm as dist
from ds_parallel.moe._all_to_all import _AllToAll
from ds_parallel.moe._dispatch import combine, dispatch, route_slots, slots_of
from ds_parallel.moe._gating import (
    Routes,
    capacity_for,
    dense_combine,
    gumbel_noise,
    route_top1,
    route_top2,
    route_topk,
    uniform_noise,
)
from ds_parallel.moe.mappings import drop_tokens, gather_tokens

logger = logging.getLogger(__name__)

__all__ = [
    "MOELayer",
    "_AllToAll",
    "_route_slots",
    "_sparse_decode",
    "_sparse_encode",
    "dist",
    "TopKGate",
    "gumbel_rsample",
    "multiplicative_jitter",
    "top1gating",
    "top2gating",
    "topkgating",
]

_NOISY_POLICIES = (None, "None", "Jitter", "RSample")


def multiplicative_jitter(x: Tensor, device: torch.device, epsilon: float = 1e-2) -> Tensor:
    """`x` times U(1 - epsilon, 1 + epsilon) noise (the "Jitter" noisy-gate policy's input noise)."""
    if epsilon == 0:
        return x
    return x * uniform_noise(x.shape, device, 1.0 - epsilon, 1.0 + epsilon)


def gumbel_rsample(shape: tuple[int, ...] | torch.Size, device: torch.device) -> Tensor:
    """Standard Gumbel samples of `shape`."""
    return gumbel_noise(torch.Size(shape), device)


def _capacity(gates: Tensor, capacity_factor: Tensor, min_capacity: Tensor) -> Tensor:
    """DeepSpeed's helper: slots per expert for `gates [S, E]` as a tensor."""
    return torch.tensor(
        capacity_for(gates.shape[0], gates.shape[1], float(capacity_factor), int(min_capacity)), dtype=torch.int64
    )


def _result(routes: Routes, sparse_routes: bool) -> tuple[Any, ...]:
    if sparse_routes:
        return (
            routes.l_aux,
            routes.capacity,
            routes.num_experts,
            routes.indices,
            routes.locations,
            routes.gates,
            routes.exp_counts,
        )
    combine_weights, dispatch_mask = dense_combine(routes)
    return routes.l_aux, combine_weights, dispatch_mask, routes.exp_counts


def _route_slots(indices: Tensor, locations: Tensor, num_experts: int, capacity: int) -> Tensor:
    """The sparse routes' rows in the flat `[E * C, M]` capacity buffer, `[k, S]` (dropped routes name one
    scratch row past the end). `indices`/`locations` are a gate's `sparse_routes` output."""
    return slots_of(indices, locations, int(num_experts), int(capacity))


def _sparse_encode(tokens: Tensor, slots: Tensor, num_experts: int, capacity: int) -> Tensor:
    """`[E, C, M]`: the tokens `[S, M]` copied into their routes' slots, zeros elsewhere (the dense form is
    `einsum("sec,sm->ecm", dispatch_mask, tokens)`)."""
    return dispatch(tokens, slots, int(num_experts), int(capacity))


def _sparse_decode(expert_output: Tensor, slots: Tensor, gates: Tensor, num_tokens: int) -> Tensor:
    """`[S, M]`: per token, the gate-weighted sum of its routes' rows of `expert_output` (`[E * C, M]` or
    `[E, C, M]`); the dense form is `einsum("sec,ecm->sm", combine_weights, expert_output)`.

    Raises:
        ValueError: `slots` does not hold `num_tokens` tokens.
    """
    if not isinstance(gates, Tensor):
        gates = torch.stack(list(gates))
    if slots.shape[-1] != num_tokens:
        raise ValueError(f"_sparse_decode: the slots route {slots.shape[-1]} tokens, not num_tokens={num_tokens}")
    return combine(expert_output, slots, gates)


def top1gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    used_token: Tensor | None = None,
    noisy_gate_policy: str | None = None,
    drop_tokens: bool = True,
    use_rts: bool = True,
    ep_group: Any = None,
    sparse_routes: bool = False,
    use_tutel: bool = False,
) -> tuple[Any, ...]:
    """Top-1 gating: `(l_aux, combine_weights [S,E,C], dispatch_mask, exp_counts)`, or with `sparse_routes`
    `(l_aux, capacity, num_experts, indices [1,S], locations [1,S], gates [1,S], exp_counts)`."""
    routes = route_top1(
        logits,
        capacity_factor,
        min_capacity,
        used_token=used_token,
        noisy_gate_policy=noisy_gate_policy,
        drop_tokens=drop_tokens,
        use_rts=use_rts,
        ep_group=ep_group,
    )
    return _result(routes, sparse_routes)


def top2gating(
    logits: Tensor,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    top2_2nd_expert_sampling: bool = True,
    sparse_routes: bool = False,
) -> tuple[Any, ...]:
    """Top-2 gating; results as `top1gating` (routes `[2, S]`)."""
    routes = route_top2(
        logits,
        capacity_factor,
        min_capacity,
        drop_tokens=drop_tokens,
        ep_group=ep_group,
        top2_2nd_expert_sampling=top2_2nd_expert_sampling,
    )
    return _result(routes, sparse_routes)


def topkgating(
    logits: Tensor,
    k: int,
    capacity_factor: float,
    min_capacity: int,
    drop_tokens: bool = True,
    ep_group: Any = None,
    drop_policy: str = "probs",
    sparse_routes: bool = False,
) -> tuple[Any, ...]:
    """Top-k gating; results as `top1gating` (routes `[k, S]`)."""
    routes = route_topk(
        logits,
        k,
        capacity_factor,
        min_capacity,
        drop_tokens=drop_tokens,
        ep_group=ep_group,
        drop_policy=drop_policy,
    )
    return _result(routes, sparse_routes)


class TopKGate(nn.Module):
    """The router: `wg` (a bias-free `Linear(model_dim, num_experts)`) scores tokens in fp32, then top-k gating.

    Args:
        model_dim: token width M.
        num_experts: E, over all ranks.
        k: experts per token (1, 2, or any k <= E).
        capacity_factor / eval_capacity_factor: capacity multiplier in training / eval mode.
        min_capacity: the least slots per expert.
        noisy_gate_policy: None, "Jitter" (multiplicative input noise) or "RSample" (Gumbel noise on the
            top-1 choice); training only.
        drop_tokens: enforce capacity (False: every route is kept, capacity = the largest count).
        use_rts: top-1 keeps a random subset of over-capacity tokens (else `torch.topk`'s pick).
        ep_group: the expert-parallel group (set later by `MoE.set_deepspeed_parallelism`).
        top2_2nd_expert_sampling: Gumbel-sample top-2's second expert.

    Raises:
        ValueError: an unknown noisy_gate_policy, or k < 1.
    """

    wg: nn.Linear

    def __init__(
        self,
        model_dim: int,
        num_experts: int,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 8,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        ep_group: Any = None,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if noisy_gate_policy not in _NOISY_POLICIES:
            raise ValueError(f"noisy_gate_policy must be one of None, 'Jitter', 'RSample'; got {noisy_gate_policy!r}")
        if k < 1 or k > num_experts:
            raise ValueError(f"TopKGate: k={k} must be between 1 and num_experts={num_experts}")
        self.wg = nn.Linear(model_dim, num_experts, bias=False)
        self.ep_group = ep_group
        self.k = k
        self.capacity_factor = capacity_factor
        self.eval_capacity_factor = eval_capacity_factor
        self.min_capacity = min_capacity
        self.noisy_gate_policy = noisy_gate_policy
        self.drop_tokens = drop_tokens
        self.use_rts = use_rts
        self.top2_2nd_expert_sampling = top2_2nd_expert_sampling
        self.wall_clock_breakdown = False
        self.gate_time = 0.0
        self.capacity_multiple = 1
        """The capacity is rounded up to a multiple of this (the tensor-parallel degree, so each tensor-parallel
        rank keeps an equal slice of every expert's slots); the extra slots stay empty."""

    def _set_ep_group(self, ep_group: Any) -> None:
        if self.ep_group is not None and self.ep_group is not ep_group:
            raise RuntimeError("TopKGate: the expert-parallel group is already set to another group")
        self.ep_group = ep_group

    def route(self, tokens: Tensor, used_token: Tensor | None = None) -> Routes:
        """Route `tokens [S, M]` (see `ds_parallel.moe._gating`)."""
        start = time.perf_counter() if self.wall_clock_breakdown else 0.0
        x = tokens.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x = multiplicative_jitter(x, device=tokens.device)
        logits = nn.functional.linear(x, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            routes = route_top1(
                logits,
                factor,
                self.min_capacity,
                used_token=used_token,
                noisy_gate_policy=self.noisy_gate_policy if self.training else None,
                drop_tokens=self.drop_tokens,
                use_rts=self.use_rts,
                ep_group=self.ep_group,
            )
        elif self.k == 2:
            routes = route_top2(
                logits,
                factor,
                self.min_capacity,
                drop_tokens=self.drop_tokens,
                ep_group=self.ep_group,
                top2_2nd_expert_sampling=self.top2_2nd_expert_sampling,
            )
        else:
            routes = route_topk(
                logits, self.k, factor, self.min_capacity, drop_tokens=self.drop_tokens, ep_group=self.ep_group
            )
        if routes.capacity % self.capacity_multiple:
            routes.capacity += self.capacity_multiple - routes.capacity % self.capacity_multiple
        if self.wall_clock_breakdown:
            self.gate_time = (time.perf_counter() - start) * 1000.0
        return routes

    def forward(
        self, input: Tensor, used_token: Tensor | None = None, sparse_routes: bool = False, use_tutel: bool = False
    ) -> tuple[Any, ...]:
        """DeepSpeed's gate output: see `top1gating` for the two forms."""
        return _result(self.route(input, used_token), sparse_routes)


class MOELayer(nn.Module):
    """Gate + local experts + the expert-parallel exchange (see the module docstring).

    Args:
        gate: a `TopKGate`.
        experts: the local experts (`Experts`), taking `[ep, E/ep, C, M]`.
        ep_group_name: `ep_size_{ep_size}`.
        ep_size: expert-parallel degree.
        num_local_experts: E / ep_size.
        use_tutel: accepted for DeepSpeed's signature; Tutel is not used (a warning says so).
    """

    def __init__(
        self,
        gate: TopKGate,
        experts: nn.Module,
        ep_group_name: str,
        ep_size: int,
        num_local_experts: int,
        use_tutel: bool = False,
    ) -> None:
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.ep_group: Any = None
        self.ep_size = ep_size
        self.ep_group_name = ep_group_name
        self.num_local_experts = num_local_experts
        self.use_tutel = False
        if use_tutel:
            logger.warning("MoE use_tutel=True: Tutel's kernels are not used; the plain dispatch runs")
        self.wall_clock_breakdown = False
        self.time_falltoall = 0.0
        self.time_salltoall = 0.0
        self.time_moe = 0.0
        self.l_aux: Tensor | None = None
        self.exp_counts: Tensor | None = None
        self.tp_group: Any = None
        self.expert_tensor_parallel = False

    def _set_ep_group(self, ep_group: Any) -> None:
        self.ep_group = ep_group
        self.gate._set_ep_group(ep_group)

    def _set_tensor_parallel(self, tp_group: Any, tp_size: int, expert_tensor_parallel: bool) -> None:
        """The model is tensor-parallel over `tp_group` (`tp_size` > 1): tokens arrive identical on its ranks.

        Each rank then sends only its 1/tp slice of every expert's capacity through the all-to-all and the
        slices are gathered back after it. Tensor-parallel experts (`expert_tensor_parallel`) need every
        token on every tensor-parallel rank, so the slices are also gathered before them and split again
        after.
        """
        self.tp_group = tp_group if tp_size > 1 else None
        self.expert_tensor_parallel = expert_tensor_parallel and tp_size > 1
        self.gate.capacity_multiple = max(tp_size, 1)

    def _exchange(self, x: Tensor) -> tuple[Tensor, float]:
        if self.ep_size == 1:
            return x.contiguous(), 0.0
        if self.ep_group is None:
            raise RuntimeError(
                f"MoE layer with ep_size={self.ep_size} has no expert-parallel group: call "
                "deepspeed.initialize() or MoE.set_deepspeed_parallelism() first"
            )
        if x.shape[0] % self.ep_size:
            raise ValueError(f"expert all-to-all: dim 0 ({x.shape[0]}) must split evenly over {self.ep_size} ranks")
        start = time.perf_counter()
        out: Tensor = _AllToAll.apply(self.ep_group, x.contiguous())  # type: ignore[no-untyped-call]
        return out, (time.perf_counter() - start) * 1000.0

    def forward(self, *input: Tensor, **kwargs: Any) -> Tensor:
        start = time.perf_counter()
        hidden = input[0]
        used_token = input[1] if len(input) > 1 else None
        model_dim = hidden.shape[-1]
        tokens = hidden.reshape(-1, model_dim)
        routes = self.gate.route(tokens, used_token)
        self.l_aux, self.exp_counts = routes.l_aux, routes.exp_counts
        slots = route_slots(routes)
        buffer = dispatch(tokens, slots, routes.num_experts, routes.capacity)
        tp = self.tp_group
        if tp is not None:  # every tensor-parallel rank holds these tokens: each sends only its slots' slice
            buffer = drop_tokens(buffer, 1, tp)
        buffer, self.time_falltoall = self._exchange(buffer)
        if self.expert_tensor_parallel:
            buffer = gather_tokens(buffer, 1, tp)
        expert_in = buffer.reshape(self.ep_size, self.num_local_experts, -1, model_dim)
        expert_out = self.experts(expert_in).reshape(self.ep_size * self.num_local_experts, -1, model_dim)
        if self.expert_tensor_parallel:
            expert_out = drop_tokens(expert_out, 1, tp)
        expert_out, self.time_salltoall = self._exchange(expert_out)
        if tp is not None:
            expert_out = gather_tokens(expert_out, 1, tp)
        out = combine(expert_out, slots, routes.gates).reshape(hidden.shape)
        self.time_moe = (time.perf_counter() - start) * 1000.0
        return out
