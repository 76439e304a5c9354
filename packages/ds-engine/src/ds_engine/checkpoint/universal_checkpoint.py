"""`deepspeed.checkpoint.universal_checkpoint`: cutting a whole parameter back to one AutoTP rank's shard.

A universal checkpoint holds each parameter whole. Loading it into a tensor-parallel model means taking
this rank's piece, and the AutoTP layer that cut the parameter recorded how on the parameter itself
(`DS_AUTOTP_UC_META`, DeepSpeed's schema, written by ds-parallel's layers). `_resolve_autotp_partition`
reads that record (DeepSpeed's semantics, order of precedence included): refused when the layer said its
cut cannot be described; whole when replicated; per sub-parameter when it is made of several (with the
recorded widths, or an even split for metadata older than version 0.4); by the recorded partition sizes;
else an even split. Needs no ds-parallel: it reads only the dict on the parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ds_engine.checkpoint.constants import DS_AUTOTP_UC_META, UNIVERSAL_CHECKPOINT_VERSION_KEY

__all__ = [
    "AutoTPRestoreError",
    "SubparamShape",
    "_get_param_uc_restore_meta",
    "_narrow_sub_params",
    "_resolve_autotp_partition",
]


class AutoTPRestoreError(AssertionError, ValueError):
    """An AutoTP record that does not describe the parameter, or an uneven cut it does not record.

    DeepSpeed reports these as failed assertions; this is both an AssertionError (what DeepSpeed's callers
    catch) and a ValueError (what it is: bad metadata), so neither kind of handler misses it.
    """


@dataclasses.dataclass
class SubparamShape:
    """One `parameter_with_sub_params` entry of `universal_checkpoint_info`: the parameters it names, their
    shape with the sub-parameters' sizes at `partition_dim`, and that dim."""

    patterns: list[str]
    shape: tuple[Any, ...]
    partition_dim: int


def _get_param_uc_restore_meta(param: torch.Tensor) -> dict[str, Any] | None:
    """The AutoTP record on `param` (its restore view; the conversion view is under "conversion")."""
    return getattr(param, DS_AUTOTP_UC_META, None)


def _narrow_sub_params(
    full_view: torch.Tensor,
    partition_dim: int,
    sub_dim_sizes: Sequence[int],
    shard_widths: Sequence[Sequence[int]] | None,
    tp_rank: int,
    tp_world_size: int,
    uc_version: float,
) -> torch.Tensor:
    """Rank `tp_rank`'s piece of every sub-parameter of `full_view` along `partition_dim`, concatenated and
    flattened. `shard_widths` (per sub-parameter, every rank's width) is used from version 0.4; older
    metadata records none, so only an even split (every size divisible by the group) can be restored.

    Raises:
        AutoTPRestoreError: the sizes or widths do not describe `full_view`, or an old record of an uneven
            split.

    """
    sizes = [int(s) for s in sub_dim_sizes]
    if sum(sizes) != full_view.shape[partition_dim]:
        raise AutoTPRestoreError(
            f"sub-parameter sizes {sizes} add up to {sum(sizes)}, but dim {partition_dim} of the parameter is "
            f"{full_view.shape[partition_dim]}: the metadata describes another parameter"
        )
    if uc_version < 0.4:
        uneven = [s for s in sizes if s % tp_world_size]
        if uneven:
            raise AutoTPRestoreError(
                f"sub-parameter sizes {uneven} are not divisible by tp_world_size {tp_world_size} and this metadata "
                "(before version 0.4) records no sub_param_shard_widths: the uneven cut cannot be rebuilt"
            )
        shard_widths = [[s // tp_world_size] * tp_world_size for s in sizes]
    if shard_widths is None or len(shard_widths) != len(sizes):
        raise AutoTPRestoreError(
            f"sub_param_shard_widths {shard_widths} do not give one entry per sub-parameter {sizes}"
        )
    pieces, start = [], 0
    for size, widths in zip(sizes, shard_widths, strict=True):
        if len(widths) != tp_world_size or sum(widths) != size:
            raise AutoTPRestoreError(
                f"shard widths {list(widths)} of a sub-parameter of size {size} are not {tp_world_size} widths "
                f"adding up to it"
            )
        pieces.append(full_view.narrow(partition_dim, start + sum(widths[:tp_rank]), widths[tp_rank]))
        start += size
    return torch.cat(pieces, dim=partition_dim).flatten()


def _resolve_autotp_partition(
    current_param: torch.Tensor,
    ckpt_dict: dict[str, Any],
    full_hp_param: torch.Tensor,
    tp_rank: int,
    tp_world_size: int,
    state_key: str = "fp32",
) -> torch.Tensor | None:
    """This rank's shard (flattened) of `full_hp_param`, the whole value of `current_param` or of one of its
    optimizer states, cut as `current_param`'s AutoTP record says; None when there is no record or it
    names no cut (the caller's own rules apply). `ckpt_dict` and `state_key` are DeepSpeed's arguments.

    Raises:
        RuntimeError: the layer recorded that its cut cannot be described.
        AutoTPRestoreError: the record does not describe the parameter, or an uneven cut it does not record.

    """
    del ckpt_dict, state_key  # used by DeepSpeed's affine-map path, which ds's records do not carry
    meta = _get_param_uc_restore_meta(current_param)
    if not meta:
        return None
    reason = (meta.get("conversion") or {}).get("unsupported_reason")
    if reason:
        raise RuntimeError(f"Cannot restore a universal checkpoint into this AutoTP parameter: {reason}")
    dim = meta.get("partition_dim")
    if meta.get("replicated", False):
        if dim is not None:
            raise AutoTPRestoreError(f"AutoTP metadata marks a parameter replicated but cut along dim {dim}")
        return full_hp_param.flatten()
    logical_shape = meta.get("logical_shape")
    if dim is None or logical_shape is None:
        return None
    full_view = full_hp_param.view(logical_shape)
    # `sub_param_sizes` are real sizes; `sub_param_shape` at the cut dim may be a count ((3, -1)), so it is
    # read only when the sizes are missing (older metadata).
    sub_sizes: Any = meta.get("sub_param_sizes")
    spec: Any = meta.get("sub_param_shape")
    if sub_sizes is None and spec is not None:
        if isinstance(spec, SubparamShape):  # a converter's entry: it names its own cut dim
            dim = spec.partition_dim
            spec = spec.shape
        sub_sizes = spec[dim]
    if sub_sizes is not None:
        if not isinstance(sub_sizes, (tuple, list)):
            sub_sizes = (sub_sizes,)
        version = meta.get(UNIVERSAL_CHECKPOINT_VERSION_KEY, 0.0)
        return _narrow_sub_params(
            full_view, dim, sub_sizes, meta.get("sub_param_shard_widths"), tp_rank, tp_world_size, version
        )
    sizes = meta.get("partition_sizes")
    if sizes is not None:
        return full_view.narrow(dim, sum(sizes[:tp_rank]), sizes[tp_rank]).flatten()
    # No recorded sizes: only an even split can be assumed (torch.chunk's ceil-sized blocks would not match
    # AutoTP's near-even shares of an uneven dim).
    if full_view.shape[dim] % tp_world_size:
        raise AutoTPRestoreError(
            f"dim {dim} of size {full_view.shape[dim]} is not divisible by tp_world_size {tp_world_size} and the "
            "metadata records no partition_sizes: the uneven cut cannot be rebuilt"
        )
    return full_view.chunk(tp_world_size, dim=dim)[tp_rank].flatten()
