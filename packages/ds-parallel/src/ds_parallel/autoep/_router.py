"""Token-choice top-k routing for AutoEP layers, with DeepSpeed 0.19.8's routing options.

Scores are computed in fp32 (softmax or sigmoid of the gate's logits); experts are chosen from the scores
plus an optional correction bias (DeepSeek-V3's `e_score_correction_bias`), optionally only within the
`num_limited_groups` best of `num_expert_groups` expert groups; the weights are the chosen experts' plain
scores, renormalized to sum to one when `route_norm`, then multiplied by `route_scale`.
"""

from __future__ import annotations

import logging
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from ds_parallel.autoep._split_plan import count_tokens_per_expert

__all__ = ["TokenChoiceTopKRouter", "TopKRouter"]

logger = logging.getLogger(__name__)


class TopKRouter(nn.Module):
    """`gate` (a bias-optional Linear, hidden -> num_experts) and the routing rule.

    Args:
        hidden_size: width of a token.
        num_experts: routed experts of the layer.
        top_k: experts per token.
        score_func: "softmax" or "sigmoid".
        route_norm: renormalize the top-k weights.
        route_scale: factor on the weights (DeepSeek-V3's `routed_scaling_factor`).
        gate_bias: the gate has a bias.
        num_expert_groups / num_limited_groups: group-limited routing (both or neither).
        group_score_func: "max" or "top2_sum", the score of a group.
    """

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        *,
        top_k: int,
        score_func: Literal["softmax", "sigmoid"],
        route_norm: bool,
        route_scale: float,
        gate_bias: bool = False,
        num_expert_groups: int | None = None,
        num_limited_groups: int | None = None,
        group_score_func: Literal["max", "top2_sum"] = "top2_sum",
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"expert_parallel.top_k={top_k} must be between 1 and num_experts={num_experts}")
        self.gate = nn.Linear(hidden_size, num_experts, bias=gate_bias)
        self.num_experts = num_experts
        self.top_k = top_k
        self.score_func = score_func
        self.route_norm = route_norm
        self.route_scale = route_scale
        self.num_expert_groups = num_expert_groups
        self.num_limited_groups = num_limited_groups
        self.group_score_func = group_score_func
        # DeepSeek-V3's selection bias (a buffer of the model, copied at conversion); None for the others.
        self.e_score_correction_bias: torch.Tensor | None
        self.register_buffer("e_score_correction_bias", None)

    def _limit_to_groups(self, choice: torch.Tensor) -> torch.Tensor:
        """Mask (-inf) every expert outside the `num_limited_groups` best groups of each token."""
        assert self.num_expert_groups is not None and self.num_limited_groups is not None
        grouped = choice.view(choice.shape[0], self.num_expert_groups, -1)
        if self.group_score_func == "max":
            group_scores = grouped.amax(dim=-1)
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep = torch.topk(group_scores, k=self.num_limited_groups, dim=-1).indices
        masked = torch.ones_like(group_scores, dtype=torch.bool).scatter_(1, keep, False)
        return grouped.masked_fill(masked.unsqueeze(-1), float("-inf")).view(choice.shape[0], -1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`x` `[T, hidden]` -> (weights `[T, top_k]` fp32, expert indices `[T, top_k]`)."""
        # In the gate's own dtype (DeepSeek keeps an fp32 router in a bf16 model), scored in fp32.
        logits = F.linear(x.to(self.gate.weight.dtype), self.gate.weight, self.gate.bias).float()
        scores = torch.sigmoid(logits) if self.score_func == "sigmoid" else F.softmax(logits, dim=-1)
        choice = scores
        if self.e_score_correction_bias is not None:
            choice = choice + self.e_score_correction_bias.float().unsqueeze(0)
        if self.num_expert_groups is not None:
            choice = self._limit_to_groups(choice)
        indices = torch.topk(choice, k=self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.route_norm:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, indices


class TokenChoiceTopKRouter(TopKRouter):
    """`TopKRouter` with DeepSpeed 0.19.8's constructor (positional, group sizes before `top_k`) and return value:
    `forward(x)` gives (weights `[T, top_k]`, expert indices `[T, top_k]`, int32 tokens per expert `[E]`).

    A load-balancing `expert_bias` is refused (DeepSpeed's AutoEP refuses `load_balance_coeff` too).
    """

    def __init__(
        self,
        dim: int,
        num_experts: int,
        num_expert_groups: int | None,
        num_limited_groups: int | None,
        top_k: int,
        score_func: Literal["softmax", "sigmoid"],
        route_norm: bool,
        route_scale: float,
        gate_bias: bool,
        group_score_func: Literal["max", "top2_sum"] = "top2_sum",
    ) -> None:
        super().__init__(
            dim,
            num_experts,
            top_k=top_k,
            score_func=score_func,
            route_norm=route_norm,
            route_scale=route_scale,
            gate_bias=gate_bias,
            num_expert_groups=num_expert_groups,
            num_limited_groups=num_limited_groups,
            group_score_func=group_score_func,
        )

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, expert_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if expert_bias is not None:
            raise ValueError("expert_bias (load_balance_coeff load balancing) is not supported; pass None")
        weights, indices = super().forward(x)
        return weights, indices, count_tokens_per_expert(indices, self.num_experts)
