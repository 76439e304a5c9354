"""Per-parameter universal-checkpoint metadata of AutoTP layers, in DeepSpeed 0.19.8's schema.

Every parameter of a tensor-parallel layer carries one dict under `DS_AUTOTP_UC_META` saying how the
layer cut it. Its top level is the *restore* view (logical shape, every rank's partition sizes, the
shard shape this rank expects), read when a whole parameter from a universal checkpoint is cut back
to this rank; its `"conversion"` entry is the smaller *conversion* view, the only part that
`collect_autotp_universal_checkpoint_info` aggregates into the model-level `universal_checkpoint_info`
that a converter (`ds_to_universal`) uses to merge the saved shards. Both the dict layout and the key
names are a file format shared with DeepSpeed, so the values here are DeepSpeed's.

The keys are spelled here rather than imported from ds-engine's `checkpoint.constants` (ds-parallel sits
below ds-engine); ds-engine's test of its constants checks the two agree.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ds_parallel.tensor._shard_sizes import TPMeta, shard_sizes

logger = logging.getLogger(__name__)

__all__ = [
    "AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS",
    "DS_AUTOTP_UC_META",
    "UC_VERSION",
    "build_param_uc_conversion_meta",
    "build_param_uc_restore_meta",
    "collect_autotp_universal_checkpoint_info",
    "param_uc_conversion_meta",
    "subparam_shard_widths",
]

#: The parameter attribute holding the metadata (DeepSpeed's `DS_AUTOTP_UC_META`).
DS_AUTOTP_UC_META = "ds_autotp_universal_checkpoint_meta"
#: DeepSpeed's `UNIVERSAL_CHECKPOINT_VERSION_KEY` / `_VALUE`: per-sub-parameter shard widths exist from 0.4.
UC_VERSION_KEY = "universal_checkpoint_version"
UC_VERSION = 0.4
#: `universal_checkpoint_info` keys (DeepSpeed's constants of the same upper-case names).
AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS = "autotp_unsupported_parameter_patterns"
PARAMETER_WITH_ROW_PARALLELISM_PATTERNS = "parameter_with_row_parallelism_patterns"
TP_REPLICATED_PARAMETER_PATTERNS = "tp_replicated_parameter_patterns"
VOCABULARY_PARAMETER_PATTERNS = "vocabulary_parameter_patterns"
PARAMETER_WITH_SUB_PARAMS = "parameter_with_sub_params"
SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
ORIGINAL_VOCAB_SIZE = "original_vocab_size"


def _shape(value: Sequence[Any] | None) -> tuple[Any, ...] | None:
    return tuple(value) if value is not None else None


def build_param_uc_conversion_meta(
    *,
    partition_type: str,
    partition_dim: int | None = None,
    sub_param_shape: Sequence[Any] | None = None,
    sub_param_shard_widths: Sequence[Sequence[int]] | None = None,
    original_shape: Sequence[int] | None = None,
    is_bias: bool = False,
    replicated: bool = False,
    unsupported_reason: str | None = None,
) -> dict[str, Any]:
    """The conversion view of one parameter: what a converter needs to merge its shards.

    Args:
        partition_type: "column" (output features cut) or "row" (input features cut).
        partition_dim: the (logical) dim that is cut; None when the parameter is not cut.
        sub_param_shape: for a parameter made of several sub-parameters along the cut dim, its shape
            with that dim's entry naming the sub-parameters (their sizes, or their count).
        sub_param_shard_widths: per sub-parameter, every rank's width of it.
        original_shape: the whole parameter's shape.
        is_bias: the parameter is its layer's bias.
        replicated: every rank holds the whole parameter.
        unsupported_reason: why the cut cannot be described (the converter refuses the parameter).

    """
    return {
        "partition_type": partition_type,
        "partition_dim": partition_dim,
        "sub_param_shape": _shape(sub_param_shape),
        "sub_param_shard_widths": sub_param_shard_widths,
        "original_shape": _shape(original_shape),
        "is_bias": is_bias,
        "replicated": replicated,
        "unsupported_reason": unsupported_reason,
    }


def build_param_uc_restore_meta(
    *,
    partition_type: str,
    partition_dim: int | None = None,
    logical_shape: Sequence[int] | None = None,
    output_shape: Sequence[int] | None = None,
    sub_param_shape: Sequence[Any] | None = None,
    sub_param_sizes: Sequence[int] | None = None,
    sub_param_shard_widths: Sequence[Sequence[int]] | None = None,
    partition_sizes: Sequence[int] | None = None,
    target_partition_shape: Sequence[int] | None = None,
    original_shape: Sequence[int] | None = None,
    is_bias: bool = False,
    replicated: bool = False,
    unsupported_reason: str | None = None,
) -> dict[str, Any]:
    """The restore view of one parameter (shapes as tuples), with its conversion view under "conversion".

    Beyond the conversion view's fields: `logical_shape` (the view the cut applies to; a fused weight may be
    viewed with more dims than it has), `output_shape` (its output dims), `sub_param_sizes` (each
    sub-parameter's size along the cut dim), `partition_sizes` (every rank's share of a plain cut) and
    `target_partition_shape` (this rank's shard shape).
    """
    return {
        UC_VERSION_KEY: UC_VERSION,
        "partition_type": partition_type,
        "partition_dim": partition_dim,
        "logical_shape": _shape(logical_shape),
        "output_shape": _shape(output_shape),
        "sub_param_shape": _shape(sub_param_shape),
        "sub_param_sizes": _shape(sub_param_sizes),
        "sub_param_shard_widths": sub_param_shard_widths,
        "partition_sizes": _shape(partition_sizes),
        "target_partition_shape": _shape(target_partition_shape),
        "original_shape": _shape(original_shape),
        "is_bias": is_bias,
        "replicated": replicated,
        "conversion": build_param_uc_conversion_meta(
            partition_type=partition_type,
            partition_dim=partition_dim,
            sub_param_shape=sub_param_shape,
            sub_param_shard_widths=sub_param_shard_widths,
            original_shape=original_shape,
            is_bias=is_bias,
            replicated=replicated,
            unsupported_reason=unsupported_reason,
        ),
    }


def param_uc_conversion_meta(param: torch.Tensor) -> dict[str, Any] | None:
    """The conversion view recorded on `param`; None for a parameter no AutoTP layer cut."""
    meta = getattr(param, DS_AUTOTP_UC_META, None)
    return meta.get("conversion") if meta else None


def subparam_shard_widths(
    subparam_sizes: Sequence[int], tp_world_size: int, meta: TPMeta | None = None, name: str | None = None
) -> list[list[int]]:
    """Every rank's width of each sub-parameter (one list per sub-parameter), by the layers' split rules.

    A sub-parameter narrower than the group (fewer heads than ranks) leaves some ranks a width of 0: they
    hold none of it and contribute nothing to the sum, as separate projections would.
    """
    widths = []
    for size in subparam_sizes:
        per_rank = list(shard_sizes(int(size), tp_world_size, meta or TPMeta(), name or ""))
        if min(per_rank) == 0:
            logger.warning(
                "AutoTP: a sub-parameter of size %d splits over %d ranks as %s; some ranks hold none of it",
                size,
                tp_world_size,
                per_rank,
            )
        widths.append(per_rank)
    return widths


def collect_autotp_universal_checkpoint_info(model: nn.Module) -> dict[str, Any]:
    """DeepSpeed's AutoTP `universal_checkpoint_info` of `model`: one exact-name pattern per parameter.

    Each AutoTP layer first re-records its metadata (`_mark_uc_metadata`, so shards changed since are seen).
    A parameter no layer cut is replicated. Of the cut ones: row-parallel weights are
    `parameter_with_row_parallelism_patterns`; parameters made of sub-parameters are
    `parameter_with_sub_params` entries (their published shape carries each sub-parameter's size, never a
    count) with `sub_param_shard_widths`; 2-D embedding / output-head parameters cut along dim 0 are
    vocabulary parameters; a cut the layer could not describe is recorded with its reason in
    `autotp_unsupported_parameter_patterns`. A tied parameter is named once, by its first name (the one
    the optimizer, and so the checkpoint, knows). Only per-rank-independent facts go in, so every rank
    produces the same dict.
    """
    canonical = {id(p): name for name, p in model.named_parameters()}
    row: list[str] = []
    replicated: list[str] = []
    vocabulary: list[str] = []
    sub_params: list[dict[str, Any]] = []
    widths_by_pattern: dict[str, list[list[int]]] = {}
    unsupported: dict[str, str] = {}
    vocab_size = None
    for module_name, module in model.named_modules():
        mark = getattr(module, "_mark_uc_metadata", None)
        if callable(mark):
            mark()
        for pname, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{pname}" if module_name else pname
            if canonical.get(id(param), full_name) != full_name:
                continue
            pattern = f"^{re.escape(full_name)}$"
            conv = param_uc_conversion_meta(param)
            if not conv:  # untouched by AutoTP: the same on every rank
                replicated.append(pattern)
                continue
            if conv.get("unsupported_reason"):
                unsupported[pattern] = conv["unsupported_reason"]
                continue
            if conv.get("replicated"):
                replicated.append(pattern)
            if conv.get("partition_type") == "row" and not conv.get("is_bias", False):
                row.append(pattern)
            original, dim = conv.get("original_shape"), conv.get("partition_dim")
            if original and len(original) == 2 and dim == 0 and ("embed" in full_name or "lm_head" in full_name):
                vocabulary.append(pattern)
                vocab_size = original[0] if vocab_size is None else vocab_size
            spec = conv.get("sub_param_shape")
            if spec is not None and dim is not None:
                published = list(spec)
                widths = conv.get("sub_param_shard_widths")
                if widths is not None:
                    published[dim] = tuple(sum(w) for w in widths)
                    widths_by_pattern[pattern] = [list(w) for w in widths]
                sub_params.append({"patterns": [pattern], "shape": published, "partition_dim": dim})
    info: dict[str, Any] = {
        UC_VERSION_KEY: UC_VERSION,
        PARAMETER_WITH_ROW_PARALLELISM_PATTERNS: sorted(set(row)),
        TP_REPLICATED_PARAMETER_PATTERNS: sorted(set(replicated)),
        VOCABULARY_PARAMETER_PATTERNS: sorted(set(vocabulary)),
        PARAMETER_WITH_SUB_PARAMS: sub_params,
        AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS: unsupported,
    }
    if widths_by_pattern:
        info[SUB_PARAM_SHARD_WIDTHS] = widths_by_pattern
    if vocab_size is not None:
        info[ORIGINAL_VOCAB_SIZE] = vocab_size
    return info


def mark_param_from_layout(
    param: torch.Tensor | None,
    layout: Any,
    original_shape: Sequence[int],
    *,
    partition_type: str,
    is_bias: bool,
    unsupported_reason: str | None = None,
) -> None:
    """Record on `param` the metadata of a cut described by a `ShardLayout` (DeepSpeed's layer schemas).

    Replicated: nothing cut. One section: a plain cut (DeepSpeed's LinearLayer / LinearAllreduce, with
    every rank's `partition_sizes`). Several sections: sub-parameters along the cut dim, each split on its
    own (DeepSpeed's sub-parameter column layers, with `sub_param_shard_widths`).
    """
    if param is None:
        return
    original = tuple(int(s) for s in original_shape)
    output = original if is_bias else original[:1]
    common: dict[str, Any] = {
        "partition_type": partition_type,
        "logical_shape": original,
        "original_shape": original,
        "is_bias": is_bias,
        "unsupported_reason": unsupported_reason,
    }
    if unsupported_reason is not None:
        meta = build_param_uc_restore_meta(partition_dim=layout.dim, **common)
    elif layout.replicated:
        meta = build_param_uc_restore_meta(output_shape=output, replicated=True, **common)
    elif len(layout.sections) == 1:
        meta = build_param_uc_restore_meta(
            partition_dim=layout.dim,
            output_shape=output,
            partition_sizes=layout.sections[0],
            target_partition_shape=tuple(param.shape),
            **common,
        )
    else:
        sizes = tuple(sum(section) for section in layout.sections)
        spec: list[Any] = list(original)
        spec[layout.dim] = sizes
        meta = build_param_uc_restore_meta(
            partition_dim=layout.dim,
            output_shape=output,
            sub_param_shape=spec,
            sub_param_sizes=sizes,
            sub_param_shard_widths=[list(section) for section in layout.sections],
            target_partition_shape=tuple(param.shape),
            **common,
        )
    setattr(param, DS_AUTOTP_UC_META, meta)
