"""The local experts of an AutoEP layer as three stacked tensors, and the variable-split all-to-all.

`w1` (gate) and `w3` (up) are `[E_local, ffn, hidden]`, `w2` (down) is `[E_local, hidden, ffn]`:
DeepSpeed 0.19.8's names and shapes, so state-dict keys match its AutoEP layer. Rows arrive grouped by
local expert with their counts; each group is one GEMM chain (no padding, no capacity, no dropped tokens).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm

__all__ = ["EXPERT_ACTIVATIONS", "GroupedExperts", "SizedGroupedExperts", "all_to_all_v"]

logger = logging.getLogger(__name__)


_ALPHA, _LIMIT = 1.702, 7.0  # the clamped forms' constants (GPT-OSS / MiniMax-M3)


def _swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    gate = gate.clamp(max=_LIMIT)
    return (up.clamp(-_LIMIT, _LIMIT) + 1) * gate * torch.sigmoid(_ALPHA * gate)


#: `expert_parallel.expert_activation` values: (gate, up) -> hidden.
EXPERT_ACTIVATIONS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "swiglu": lambda gate, up: F.silu(gate) * up,
    "geglu_tanh": lambda gate, up: F.gelu(gate, approximate="tanh") * up,
    "swiglu_clamped": lambda gate, up: F.silu(gate.clamp(max=_LIMIT)) * up.clamp(-_LIMIT, _LIMIT),
    "swiglu_oai": _swiglu_oai,
}


class GroupedExperts(nn.Module):
    """`E_local` gated MLPs; `forward(rows, counts)` runs rows `[sum(counts), hidden]` grouped by expert.

    `gate_act` is the model's own activation module (kept so `hidden_act` is honoured) when the expert
    activation is the plain gated form; otherwise the named activation applies to (gate, up).
    """

    def __init__(
        self,
        w1: torch.Tensor,
        w2: torch.Tensor,
        w3: torch.Tensor,
        *,
        activation: str,
        gate_act: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.w1 = nn.Parameter(w1.detach().clone())
        self.w2 = nn.Parameter(w2.detach().clone())
        self.w3 = nn.Parameter(w3.detach().clone())
        self.activation = activation
        self.gate_act = gate_act if activation == "swiglu" else None

    @property
    def num_experts(self) -> int:
        return int(self.w1.shape[0])

    def _hidden(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.gate_act is not None:
            return self.gate_act(gate) * up
        return EXPERT_ACTIVATIONS[self.activation](gate, up)

    def forward(self, rows: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(counts, torch.Tensor):  # a host list for split: one device sync here, not one per expert
            counts = counts.tolist()
        outs = []
        for e, chunk in enumerate(torch.split(rows, counts)):
            if chunk.shape[0] == 0:
                continue
            hidden = self._hidden(F.linear(chunk, self.w1[e]), F.linear(chunk, self.w3[e]))
            outs.append(F.linear(hidden, self.w2[e]))
        if not outs:  # no token here: keep every expert weight in the graph (zero gradient, not None)
            zero = (self.w1.sum() + self.w2.sum() + self.w3.sum()) * 0
            return rows.new_zeros((0, self.w2.shape[1])) + zero
        return torch.cat(outs)


class SizedGroupedExperts(GroupedExperts):
    """`GroupedExperts` made from sizes, DeepSpeed 0.19.8's constructor: `num_experts` gated MLPs of width `dim`
    and hidden width `hidden_dim`, weights uninitialized (`torch.empty`) for the caller to fill or load.

    `use_grouped_mm` is a kernel choice in DeepSpeed; ds runs each expert's GEMMs in turn either way.
    """

    def __init__(
        self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True, activation: str = "swiglu"
    ) -> None:
        del use_grouped_mm
        if activation not in EXPERT_ACTIVATIONS:
            raise ValueError(f"activation={activation!r} must be one of {sorted(EXPERT_ACTIVATIONS)}")
        gate_up = torch.empty(num_experts, hidden_dim, dim)
        super().__init__(gate_up, torch.empty(num_experts, dim, hidden_dim), gate_up, activation=activation)


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> Any:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        ds_comm.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return None, _AllToAllV.apply(ctx.group, grad, ctx.in_splits, ctx.out_splits), None, None


def all_to_all_v(x: torch.Tensor, group: ProcessGroup, *, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    """Send `in_splits[j]` rows of `x` to rank j of `group`, receive `out_splits[j]` from it (differentiable;
    the backward is the reverse exchange). One `all_to_all_single` on `group`."""
    out: torch.Tensor = _AllToAllV.apply(group, x, out_splits, in_splits)
    return out
