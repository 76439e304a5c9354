"""How one dimension splits over the tensor-parallel ranks (DeepSpeed's `get_shard_size` rules).

Attention projections split by key/value heads (each rank takes whole heads, so grouped-query
attention keeps its q-to-kv ratio on every rank); MLP projections and the output head split near
evenly in units of `tp_grain_size`. The split is computed once per layer and frozen: the forward,
the weight gather and checkpoint conversion all read the same sizes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["TPMeta", "shard_size", "shard_sizes"]

#: Config attributes holding the key/value head count, in the order DeepSpeed probes them; the
#: query-head names last (a plain transformer has as many kv heads as query heads).
_KV_HEAD_ATTRS = (
    "num_key_value_heads",
    "num_kv_heads",
    "multi_query_group_num",
    "n_head_kv",
    "kv_n_heads",
    "num_attention_heads",
    "n_heads",
    "attention_heads",
)
_ATTN_HEAD_ATTRS = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
_HIDDEN_ATTRS = ("n_embd", "hidden_size")
#: Layer names that never split by heads.
_LM_HEAD_NAMES = ("lm_head", "embed_out")
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def _first_attr(config: Any, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPMeta:
    """Per-model facts the split depends on, read from the model's config once."""

    num_kv_heads: int | None = None
    """Key/value heads (None: unknown, every dimension splits near evenly)."""
    num_attention_heads: int | None = None
    """Query heads."""
    hidden_size: int | None = None
    """Model width."""
    tp_grain_size: int = 1
    """MLP and output-head shards are multiples of this (the last rank takes the remainder)."""

    @classmethod
    def from_model_config(cls, config: Any, tp_grain_size: int = 1) -> TPMeta:
        """Read the head counts from a Hugging Face style config (its `text_config` when it has one)."""
        if config is None:
            return cls(tp_grain_size=tp_grain_size)
        config = getattr(config, "text_config", None) or config
        return cls(
            num_kv_heads=_first_attr(config, _KV_HEAD_ATTRS),
            num_attention_heads=_first_attr(config, _ATTN_HEAD_ATTRS),
            hidden_size=_first_attr(config, _HIDDEN_ATTRS),
            tp_grain_size=tp_grain_size,
        )


def _splits_by_heads(total: int, meta: TPMeta, name: str) -> bool:
    if meta.num_kv_heads is None or total % meta.num_kv_heads:
        return False
    return "mlp" not in name and name.split(".")[-1] not in _LM_HEAD_NAMES and not any(s in name for s in _MLP_NAMES)


def shard_size(total: int, tp_size: int, meta: TPMeta, name: str, rank: int) -> int:
    """Rank `rank`'s (0 <= rank < tp_size) share of a dimension of `total` in the layer called `name`."""
    if _splits_by_heads(total, meta, name):
        assert meta.num_kv_heads is not None
        heads = meta.num_kv_heads // tp_size + (1 if rank < meta.num_kv_heads % tp_size else 0)
        return total * heads // meta.num_kv_heads
    grain = meta.tp_grain_size
    if total >= grain:
        units, remainder = divmod(total, grain)
        size = (units // tp_size + (1 if rank < units % tp_size else 0)) * grain
        return size + remainder if rank == tp_size - 1 else size
    return total // tp_size + (1 if rank < total % tp_size else 0)


def shard_sizes(total: int, tp_size: int, meta: TPMeta, name: str) -> tuple[int, ...]:
    """Every rank's share, in rank order; they tile `total` exactly."""
    sizes = tuple(shard_size(total, tp_size, meta, name, r) for r in range(tp_size))
    assert sum(sizes) == total, f"shard sizes {sizes} of {name!r} do not add up to {total}"
    return sizes
