"""`UlyssesSPViTAttention`: a ViT encoder's attention with its patch sequence sharded over the SP ranks.

ViT attention is not causal: every patch attends to every patch, so each rank needs the whole sequence
inside attention. The wrapper gathers the patch slices (differentiably: each rank's later layers see only
their own slice, and the gradient of a slice sums what every rank's attention sends back), runs the
wrapped attention unchanged on the whole sequence, and keeps this rank's slice of the output. Outside
attention (layer norms, MLP) every activation stays 1/P per rank.

A CLS token, where the ViT has one, is first in every rank's slice and is not sharded: each rank holds it.
Slices may differ in length (the first ranks one patch more); they are trimmed before attention, so it
sees exactly the real patches.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._autosp_gather import gather_sequence, slice_lengths

__all__ = ["UlyssesSPViTAttention"]

logger = logging.getLogger(__name__)


class UlyssesSPViTAttention(nn.Module):
    """Wrap `attn` (`hidden_states [b, s, h] -> output` or a tuple led by it) for sequence-sharded patches.

    Args:
        attn: the ViT attention module.
        process_group: the sequence-parallel group.
        has_cls_token: the first token of every rank's slice is the (replicated) CLS token.
    """

    def __init__(self, attn: nn.Module, process_group: ProcessGroup | None, has_cls_token: bool = True) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = ds_comm.get_world_size(process_group)
        self.has_cls_token = has_cls_token

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if hidden_states.dim() != 3:
            raise ValueError(
                f"UlyssesSPViTAttention: hidden_states must be [batch, seq, hidden], got {tuple(hidden_states.shape)}"
            )
        lead = 1 if self.has_cls_token else 0
        patches = hidden_states[:, lead:]
        lengths = slice_lengths(patches.shape[1], self.process_group, hidden_states.device)
        full = gather_sequence(patches, self.process_group, lengths)
        if lead:
            full = torch.cat([hidden_states[:, :1], full], dim=1)
        result = self.attn(full, *args, **kwargs)
        out, extra = (result[0], tuple(result[1:])) if isinstance(result, (tuple, list)) else (result, ())
        rank = ds_comm.get_rank(self.process_group) if self.world_size > 1 else 0
        start = lead + sum(lengths[:rank])
        local = out[:, start : start + lengths[rank]]
        if lead:
            local = torch.cat([out[:, :1], local], dim=1)
        return (local, *extra) if extra or isinstance(result, (tuple, list)) else local
