"""DeepSpeed's `module_inject.tp_shard` surface over ds's shard-size rules (`_shard_sizes.py`).

DeepSpeed names the per-model facts `AutoTPMeta` (its model width is `n_embd`) and asks for a share with
`get_shard_size(total_size, mp_size, meta, name, rank)` / `get_shard_size_list(total_size, mp_size, meta,
name)`. Older DeepSpeed releases, and scripts written for them, call `get_shard_size_list(total_size,
mp_size, name)` with no meta (the head counts were process-wide then); that form is accepted too and
splits near evenly, as those releases did before any kv-head count was set. The rules themselves are
`shard_size`'s: one implementation, so a DeepSpeed-style caller and ds's layers never disagree.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ds_comm
from ds_parallel.tensor._shard_sizes import TPMeta, shard_size, shard_sizes

__all__ = ["AutoTPMeta", "get_shard_size", "get_shard_size_list"]


@dataclasses.dataclass(frozen=True)
class AutoTPMeta:
    """DeepSpeed's per-model AutoTP facts: head counts, model width (`n_embd`) and the MLP grain size."""

    num_kv_heads: int | None = None
    num_attention_heads: int | None = None
    n_embd: int | None = None
    tp_grain_size: int = 1

    @classmethod
    def from_model_config(cls, model_config: Any, tp_grain_size: int = 1) -> AutoTPMeta:
        """Read the counts from a Hugging Face style config, as `TPMeta.from_model_config` does."""
        meta = TPMeta.from_model_config(model_config, tp_grain_size)
        return cls.from_tp_meta(meta)

    @classmethod
    def from_tp_meta(cls, meta: TPMeta) -> AutoTPMeta:
        """The same facts under DeepSpeed's field names."""
        return cls(
            num_kv_heads=meta.num_kv_heads,
            num_attention_heads=meta.num_attention_heads,
            n_embd=meta.hidden_size,
            tp_grain_size=meta.tp_grain_size,
        )

    def to_tp_meta(self) -> TPMeta:
        """ds's `TPMeta` holding the same facts (`n_embd` is its `hidden_size`)."""
        return TPMeta(
            num_kv_heads=self.num_kv_heads,
            num_attention_heads=self.num_attention_heads,
            hidden_size=self.n_embd,
            tp_grain_size=self.tp_grain_size,
        )


def _meta_and_name(meta: Any, name: str | None) -> tuple[TPMeta, str]:
    """Accept `AutoTPMeta`, `TPMeta`, None, or (the older call form) the layer name in `meta`'s place."""
    if isinstance(meta, str):
        if name is not None:
            raise TypeError(f"get_shard_size: meta is the string {meta!r} and name {name!r} is given too")
        return TPMeta(), meta
    if meta is None:
        return TPMeta(), name or ""
    if isinstance(meta, AutoTPMeta):
        return meta.to_tp_meta(), name or ""
    if isinstance(meta, TPMeta):
        return meta, name or ""
    raise TypeError(f"get_shard_size: meta must be an AutoTPMeta (or TPMeta), got {type(meta).__name__}")


def get_shard_size(
    total_size: int,
    mp_size: int,
    meta: Any = None,
    name: str | None = None,
    rank: int | None = None,
    mp_group: Any = None,
) -> int:
    """Rank `rank`'s share (its rank in the tensor-parallel group) of a dimension of `total_size`.

    Without `rank` it is this process's rank in `mp_group`, or in the world when the world is the group.

    Raises:
        ValueError: no rank given, no group, and the world is not `mp_size` ranks (the rank is unknown).
    """
    tp_meta, layer = _meta_and_name(meta, name)
    if rank is None:
        if mp_group is not None:
            rank = ds_comm.get_rank(mp_group)
        else:
            world = ds_comm.get_world_size()
            if world != mp_size:
                raise ValueError(
                    f"get_shard_size needs a rank within the tensor-parallel group or mp_group when mp_size "
                    f"({mp_size}) differs from the world size ({world})"
                )
            rank = ds_comm.get_rank()
    return shard_size(total_size, mp_size, tp_meta, layer, rank)


def get_shard_size_list(total_size: int, mp_size: int, meta: Any = None, name: str | None = None) -> list[int]:
    """Every rank's share of a dimension of `total_size`, in rank order (they add up to it)."""
    tp_meta, layer = _meta_and_name(meta, name)
    return list(shard_sizes(total_size, mp_size, tp_meta, layer))
