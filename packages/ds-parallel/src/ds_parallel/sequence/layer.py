"""`DistributedAttention`: DeepSpeed-Ulysses around any local attention (`deepspeed.sequence.layer`).

Each rank holds `1/P` of the sequence. Before attention one all-to-all per input trades that for all of
the sequence and `1/P` of the heads, so the unchanged local attention sees whole sequences; a last
all-to-all trades back. Activations outside attention stay `1/P` per rank; attention itself is exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.sequence._all_to_all import seq_all_to_all
from ds_parallel.sequence._layout_all_to_all import _SeqAllToAll, single_all_to_all
from ds_parallel.sequence._rotary import _rotate_half, apply_rotary_pos_emb

__all__ = [
    "DistributedAttention",
    "_SeqAllToAll",
    "_rotate_half",
    "apply_rotary_pos_emb",
    "head_split_sizes",
    "single_all_to_all",
]


def head_split_sizes(num_heads: int, world: int) -> list[int]:
    """Heads per rank: as even as possible, the first `num_heads % world` ranks one more."""
    base, extra = divmod(num_heads, world)
    return [base + (1 if r < extra else 0) for r in range(world)]


class DistributedAttention(nn.Module):
    """Sequence-parallel attention over `sequence_process_group` (DeepSpeed's signature).

    Args:
        local_attention: any callable `(q, k, v, *args, **kwargs) -> context` on whole sequences
            (eager attention, `F.scaled_dot_product_attention`, flash attention, a module).
        sequence_process_group: the sequence-parallel group (P ranks, each with 1/P of the sequence).
        scatter_idx: the heads dim of q/k/v (2 for `[s, b, h, d]` and `[b, s, h, d]`).
        gather_idx: the sequence dim as DeepSpeed names it (0, also for the batch-first layout:
            indexes below 2 mean "the sequence dim", which `batch_dim_idx` places).
        sp_stream: accepted for DeepSpeed compatibility; the all-to-alls run on the current stream.

    Head counts that P does not divide are split as evenly as possible (the first `h % P` ranks take one
    head more) when q, k and v have the same head count; with fewer key/value heads than query heads
    (GQA) both counts must be multiples of P, so each rank keeps whole query groups with their kv head.
    """

    def __init__(
        self,
        local_attention: Callable[..., torch.Tensor] | nn.Module,
        sequence_process_group: ProcessGroup | None,
        scatter_idx: int = 2,
        gather_idx: int = 0,
        sp_stream: Any = None,
    ) -> None:
        super().__init__()
        if not callable(local_attention):
            raise TypeError(
                f"DistributedAttention: local_attention must be callable, got {type(local_attention).__name__}"
            )
        if scatter_idx < 2:
            raise ValueError(f"DistributedAttention: scatter_idx is the heads dim and must be >= 2, got {scatter_idx}")
        if gather_idx >= 2:
            raise ValueError(
                f"DistributedAttention: gather_idx is the sequence dim and must be 0 or 1, got {gather_idx}"
            )
        self.local_attn = local_attention
        self.spg = sequence_process_group
        self.scatter_idx = scatter_idx
        self.gather_idx = gather_idx
        self.sp_stream = sp_stream
        if sp_stream is not None:
            warnings.warn(
                "DistributedAttention: sp_stream has no effect in ds (the all-to-alls run on the current stream)",
                UserWarning,
                stacklevel=2,
            )

    def _heads(self, name: str, t: torch.Tensor, world: int) -> list[int]:
        h = t.size(self.scatter_idx)
        if h < world:
            raise ValueError(
                f"DistributedAttention: {name} has {h} heads (dim {self.scatter_idx} of "
                f"{tuple(t.shape)}), fewer than the {world} sequence-parallel ranks"
            )
        return head_split_sizes(h, world)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        batch_dim_idx: int = 1,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Attention over the whole sequence for this rank's shard of it.

        Args:
            query, key, value: this rank's sequence shard, `[s/P, b, h, d]` (`batch_dim_idx=1`) or
                `[b, s/P, h, d]` (`batch_dim_idx=0`); every rank's shard has the same length.
            batch_dim_idx: 0 or 1, where the batch dim is (the sequence dim is the other of 0 and 1).
            *args, **kwargs: passed to the local attention (`attn_mask`, `is_causal`, ...).

        Returns:
            The context for this rank's shard, in the layout the local attention returns it for whole
            sequences with the heads dim at `scatter_idx` (separate heads, or heads x head_dim merged).
        """
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"DistributedAttention: batch_dim_idx must be 0 or 1, got {batch_dim_idx!r}")
        seq_dim = 1 - batch_dim_idx
        world = ds_comm.get_world_size(self.spg)
        for name, t in (("query", query), ("key", key), ("value", value)):
            if t.dim() <= self.scatter_idx:
                raise ValueError(
                    f"DistributedAttention: {name} has shape {tuple(t.shape)}, no heads dim {self.scatter_idx}"
                )
            if t.size(seq_dim) != query.size(seq_dim):
                raise ValueError(
                    f"DistributedAttention: {name} has {t.size(seq_dim)} positions but query has "
                    f"{query.size(seq_dim)} (dim {seq_dim})"
                )
        if world == 1:
            return self.local_attn(query, key, value, *args, **kwargs)
        hq, hk, hv = (t.size(self.scatter_idx) for t in (query, key, value))
        if not hq == hk == hv and (hq % world or hk % world or hv % world):
            raise ValueError(
                f"DistributedAttention: query/key/value heads {hq}/{hk}/{hv} differ (GQA), so each "
                f"must be a multiple of the {world} sequence-parallel ranks"
            )
        seq = [query.size(seq_dim)] * world
        parts = []
        for name, t in (("query", query), ("key", key), ("value", value)):
            parts.append(
                seq_all_to_all(
                    t,
                    self.spg,
                    scatter_dim=self.scatter_idx,
                    gather_dim=seq_dim,
                    scatter_sizes=self._heads(name, t, world),
                    gather_sizes=seq,
                )
            )
        context = self.local_attn(*parts, *args, **kwargs)
        q_heads = self._heads("query", query, world)
        me = ds_comm.get_rank(self.spg)
        width, rest = divmod(context.size(self.scatter_idx), q_heads[me])
        if rest:
            raise ValueError(
                f"DistributedAttention: the local attention returned shape {tuple(context.shape)}, "
                f"whose dim {self.scatter_idx} is not a multiple of this rank's {q_heads[me]} heads"
            )
        full_seq = context.size(seq_dim)
        if full_seq != sum(seq):
            raise ValueError(
                f"DistributedAttention: the local attention returned {full_seq} positions along dim "
                f"{seq_dim}, expected the whole sequence {sum(seq)}"
            )
        return seq_all_to_all(
            context,
            self.spg,
            scatter_dim=seq_dim,
            gather_dim=self.scatter_idx,
            scatter_sizes=seq,
            gather_sizes=[h * width for h in q_heads],
        )


# DeepSpeed's module also carries its all-to-all by layout and the rotary embedding (FPDT uses both).
_torchembed_available = False  # no fused rotary kernel: the PyTorch formula always runs
