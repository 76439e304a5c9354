"""Differentiable gather of sequence slices of different lengths along dim 1 (`[batch, seq, hidden]`).

AutoSP's ViT wrapper and fusion adapters rebuild a whole sequence from per-rank slices. The gather must
carry gradients back to every rank's own slice (each rank's later layers use the whole sequence), and
slices may differ in length (patches that do not divide evenly), so they are padded to the longest for
the collective and trimmed after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._all_gather import all_gather_autograd

__all__ = ["gather_sequence", "slice_lengths"]


def slice_lengths(local_len: int, group: ProcessGroup | None, device: torch.device) -> list[int]:
    """Every rank's slice length along the sequence, in rank order."""
    world = ds_comm.get_world_size(group)
    if world == 1:
        return [local_len]
    out = torch.zeros(world, dtype=torch.long, device=device)
    ds_comm.all_gather_into_tensor(out, torch.tensor([local_len], dtype=torch.long, device=device), group=group)
    return [int(n) for n in out.tolist()]


def gather_sequence(x: torch.Tensor, group: ProcessGroup | None, lengths: list[int]) -> torch.Tensor:
    """`[b, sum(lengths), h]`: the ranks' `[b, lengths[r], h]` slices in rank order (differentiable)."""
    if len(lengths) == 1:
        return x
    longest = max(lengths)
    padded = F.pad(x, (0, 0, 0, longest - x.shape[1])) if x.shape[1] < longest else x
    every = all_gather_autograd(padded.contiguous(), group)  # [world, b, longest, h]
    return torch.cat([every[r][:, :n] for r, n in enumerate(lengths)], dim=1)
