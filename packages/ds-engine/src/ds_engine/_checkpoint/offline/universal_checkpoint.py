"""`deepspeed.checkpoint.universal_checkpoint`: cutting a whole parameter back to one AutoTP rank's shard.

A universal checkpoint holds each parameter whole. Loading it into a tensor-parallel model means taking
this rank's piece, and the AutoTP layer that cut the parameter recorded how on the parameter itself
(`DS_AUTOTP_UC_META`, DeepSpeed's schema, written by ds-parallel's layers). `_resolve_autotp_partition`
reads that record (DeepSpeed's semantics, order of precedence included): refused when the layer said its
cut cannot be described; whole when replicated; per sub-parameter when it is made of several (with the
recorded widths, or an even split for metadata older than version 0.4); by the recorded partition sizes;
else an even split. Needs no ds-parallel: it reads only the dict on the parameter.

`load_hp_checkpoint_state` (bound on a parameter by `enable_universal_checkpoint`, as DeepSpeed's ZeRO
and bf16 optimizers bind it) loads one parameter's folder of a universal checkpoint (`fp32.pt`, its
optimizer states, `step.pt`) into the parameter's high-precision fragment, DeepSpeed's `_hp_mapping`
protocol (`lp_fragment_address` start/numel, `get_hp_fragment()`, `optim_fragment`). This rank's shard
is the AutoTP record's cut when the parameter has one (even when the whole parameter fits one rank, as a
single key/value head does), else DeepSpeed's rules from the file's own keys (`cat_dim`,
`param_n_sub_params`, `sub_param_shape`, vocabulary padding). ds's own optimizers restore universal
checkpoints through `ds_zero.load_universal_partitions` instead and keep no `_hp_mapping`.
"""

from __future__ import annotations

import dataclasses
import os
import types
from collections.abc import Iterable, Sequence
from typing import Any

import torch

import ds_comm
from ds_engine._checkpoint.constants import (
    CAT_DIM,
    DS_AUTOTP_UC_META,
    EP_IS_EXPERT_PARAM,
    EP_NUM_EXPERTS,
    FP32_WEIGHT_KEY,
    PARAM,
    PARAM_N_SUB_PARAMS,
    SUB_PARAM_SHAPE,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    VOCAB_TENSOR,
)

__all__ = [
    "AutoTPRestoreError",
    "SubparamShape",
    "_get_param_uc_restore_meta",
    "_narrow_sub_params",
    "_resolve_autotp_partition",
    "enable_universal_checkpoint",
    "load_hp_checkpoint_state",
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


def _load_state_file(path: str) -> Any:
    """A universal state file, through ds's restricted unpickler (which also admits `SubparamShape`)."""
    names: list[Any] = [SubparamShape, (SubparamShape, "deepspeed.checkpoint.universal_checkpoint.SubparamShape")]
    with torch.serialization.safe_globals(names):
        return ds_comm.load_checkpoint_file(path)


def _generic_tp_slice(
    ckpt_dict: dict[str, Any], full: torch.Tensor, numel: int, tp_rank: int, tp_world_size: int, path: str
) -> torch.Tensor:
    """DeepSpeed's cut of a parameter with no AutoTP record: by the file's sub-parameters or `cat_dim`."""
    if full.numel() != tp_world_size * numel:
        raise AutoTPRestoreError(
            f"{path}: the whole parameter has {full.numel()} elements, not {tp_world_size} ranks x {numel}"
        )
    spec = ckpt_dict.get(SUB_PARAM_SHAPE)
    dim = int(ckpt_dict.get(CAT_DIM, 0))
    n_sub = int(ckpt_dict.get(PARAM_N_SUB_PARAMS, 1))
    if spec:
        fields: dict[str, Any] = spec if isinstance(spec, dict) else dataclasses.asdict(spec)
        part_dim, shape = int(fields["partition_dim"]), fields["shape"]
        sizes = shape[part_dim] if isinstance(shape[part_dim], (tuple, list)) else (shape[part_dim],)
        view = full.view([sum(d) if isinstance(d, (tuple, list)) else d for d in shape])
        pieces, start = [], 0
        for size in sizes:
            pieces.append(view.narrow(part_dim, start, size).chunk(tp_world_size, dim=part_dim)[tp_rank])
            start += size
        return torch.cat(pieces, dim=part_dim).flatten()
    if n_sub > 1:
        subs = full.chunk(n_sub, dim=dim)
        return torch.cat([p.chunk(tp_world_size, dim=dim)[tp_rank] for p in subs], dim=dim).flatten()
    return full.chunk(tp_world_size, dim)[tp_rank].flatten()


def load_hp_checkpoint_state(
    self: torch.Tensor, folder: str, tp_rank: int, tp_world_size: int, ep_rank: int = 0, ep_size: int = 1
) -> Any:
    """Load `folder` (one parameter of a universal checkpoint) into this parameter's `_hp_mapping`.

    `fp32` is copied into the high-precision fragment; every other state becomes
    `_hp_mapping.optim_fragment[name]`. Expert parameters (`is_expert_param`) are first cut to this
    expert-parallel rank's experts when `ep_size` > 1.

    Returns:
        The value of `step.pt`, or None when there is none.

    Raises:
        AutoTPRestoreError: the file does not fit the parameter (element counts, expert counts).
        RuntimeError: the AutoTP record says the cut cannot be restored.
    """
    mapping = self._hp_mapping  # type: ignore[attr-defined]
    mapping.optim_fragment = {}
    has_meta = _get_param_uc_restore_meta(self) is not None
    step = None
    for file in sorted(os.listdir(folder)):
        if not file.endswith(".pt"):
            continue
        key, path = file[: -len(".pt")], os.path.join(folder, file)
        ckpt_dict = _load_state_file(path)
        if key == "step":
            step = ckpt_dict
            continue
        full = ckpt_dict[PARAM]
        is_expert = bool(ckpt_dict.get(EP_IS_EXPERT_PARAM, False))
        if is_expert and ep_size > 1:
            experts = ckpt_dict.get(EP_NUM_EXPERTS)
            if experts is None or full.shape[0] != experts or experts % ep_size:
                raise AutoTPRestoreError(
                    f"{path}: expert parameter with {EP_NUM_EXPERTS}={experts} and dim 0 of {full.shape[0]} cannot "
                    f"be split over {ep_size} expert-parallel ranks"
                )
            local = experts // ep_size
            full = full[ep_rank * local : (ep_rank + 1) * local]
        rank, world = tp_rank, tp_world_size
        if full.shape == self.shape and not has_meta:  # whole on every rank (replicated or averaged)
            rank, world = 0, 1
        if ckpt_dict.get(VOCAB_TENSOR, False) and not is_expert and not has_meta:
            padded = self.shape[0] * world
            if padded < full.shape[0]:
                raise AutoTPRestoreError(
                    f"{path}: vocabulary of {full.shape[0]} rows exceeds {world} x {self.shape[0]}"
                )
            full = torch.nn.functional.pad(full, (0, 0, 0, padded - full.shape[0]))
        tp_slice = _resolve_autotp_partition(self, ckpt_dict, full, rank, world, state_key=key)
        if tp_slice is None:
            tp_slice = _generic_tp_slice(ckpt_dict, full, self.numel(), rank, world, path)
        address = mapping.lp_fragment_address
        fragment = tp_slice.narrow(0, address.start, address.numel)
        if key == FP32_WEIGHT_KEY:
            target = mapping.get_hp_fragment()
            if target.numel() != address.numel:
                raise AutoTPRestoreError(f"{path}: fragment of {address.numel} elements into {target.numel()}")
            target.data.copy_(fragment.data)
        else:
            mapping.optim_fragment[key] = fragment.clone().detach()
    return step


def enable_universal_checkpoint(param_list: Iterable[torch.Tensor]) -> None:
    """Bind `load_hp_checkpoint_state` on each parameter (as `param.load_hp_checkpoint_state(folder, ...)`)."""
    for param in param_list:
        param.load_hp_checkpoint_state = types.MethodType(load_hp_checkpoint_state, param)  # type: ignore[attr-defined]
