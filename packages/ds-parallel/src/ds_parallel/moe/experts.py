"""`Experts`: this rank's copies of the expert module, marked as expert parameters."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

__all__ = ["Experts"]


class Experts(nn.Module):
    """`num_local_experts` deep copies of `expert` in `deepspeed_experts` (DeepSpeed's parameter names).

    Every parameter gets `allreduce = False` and `group_name = expert_group_name`, DeepSpeed's marks: the
    engine and ZeRO reduce such gradients over that name's expert-data-parallel group, not data parallel.

    `forward` takes `[..., num_local_experts, C, M]`-shaped input chunked on dim 1 (`[ep, E_local, C, M]`)
    and runs chunk i through expert i; a tuple output's first item is used.
    """

    def __init__(self, expert: nn.Module, num_local_experts: int = 1, expert_group_name: str | None = None) -> None:
        super().__init__()
        self.deepspeed_experts = nn.ModuleList([copy.deepcopy(expert) for _ in range(num_local_experts)])
        self.num_local_experts = num_local_experts
        for module in self.deepspeed_experts:
            for param in module.parameters():
                param.allreduce = False  # type: ignore[attr-defined]
                param.group_name = expert_group_name  # type: ignore[attr-defined]

    def forward(self, inputs: Tensor) -> Tensor:
        outputs: list[torch.Tensor] = []
        for chunk, module in zip(inputs.chunk(self.num_local_experts, dim=1), self.deepspeed_experts, strict=True):
            out = module(chunk)
            outputs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outputs, dim=1)
