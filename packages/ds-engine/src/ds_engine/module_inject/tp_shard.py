"""`deepspeed.module_inject.tp_shard`: how AutoTP splits a dimension over the tensor-parallel ranks.

DeepSpeed's names for ds-parallel's split rules (`ds_parallel.tensor.shard_size` / `shard_sizes`):
`get_shard_size(total_size, mp_size, meta, name=None, rank=None, mp_group=None)` and
`get_shard_size_list(total_size, mp_size, meta, name=None)`, with `AutoTPMeta` (ds-parallel's `TPMeta`:
the same fields, with the model width called `hidden_size` where DeepSpeed says `n_embd`). Needs the
`parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_engine import comm as dist
from ds_engine._optional import require

if TYPE_CHECKING:
    from ds_parallel.tensor import TPMeta

__all__ = ["AutoTPMeta", "get_shard_size", "get_shard_size_list"]


def _rules() -> Any:
    """ds-parallel's `tensor` package (an ImportError naming the `parallel` extra when it is missing)."""
    require(
        "ds_parallel", extra="parallel", feature="ds_engine.module_inject.tp_shard (deepspeed.module_inject.tp_shard)"
    )
    from ds_parallel import tensor

    return tensor


#: DeepSpeed's name for the per-model split facts (ds-parallel's `TPMeta`).
AutoTPMeta = _rules().TPMeta


def get_shard_size(
    total_size: int, mp_size: int, meta: TPMeta, name: str | None = None, rank: int | None = None, mp_group: Any = None
) -> int:
    """This rank's share of a dimension of `total_size` split over `mp_size` tensor-parallel ranks.

    `rank` is the rank inside the tensor-parallel group; without it, the rank in `mp_group`, or (with no
    group) the global rank, which only makes sense when the whole world is one tensor-parallel group.

    Raises:
        ValueError: no `rank` or `mp_group`, and `mp_size` is not the world size.
    """
    if rank is None:
        if mp_group is not None:
            rank = dist.get_rank(group=mp_group)
        else:
            world_size = dist.get_world_size()
            if world_size != mp_size:
                raise ValueError(
                    f"get_shard_size needs rank= (in the tensor-parallel group) or mp_group= when mp_size "
                    f"({mp_size}) differs from the world size ({world_size})"
                )
            rank = dist.get_rank()
    return int(_rules().shard_size(total_size, mp_size, meta, str(name), rank))


def get_shard_size_list(total_size: int, mp_size: int, meta: TPMeta, name: str | None = None) -> list[int]:
    """Every tensor-parallel rank's share, in rank order; they add up to `total_size`."""
    return list(_rules().shard_sizes(total_size, mp_size, meta, str(name)))
