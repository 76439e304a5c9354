"""`tp_model_init`: record tensor-parallel arguments, and merge them into the config at initialize().

As in DeepSpeed 0.19.8, `tp_model_init(model, tp_size, dtype, tp_group=None)` shards nothing: it
records its arguments (a second call must repeat them) and switches AutoTP to training mode. The next
initialize() merges the record into the config, the config being the canonical source:

* `tensor_parallel.autotp_size` (and `tensor_parallel.tp.tp_size`) unset take `tp_size`; set to
  another value, an error;
* the training dtype (`bf16`/`fp16` enabled) and an explicit `tensor_parallel.dtype` must be `dtype`;
* a recorded `tp_group` must have `tp_size` ranks and excludes an `mpu=` argument (one source of
  groups). ds builds its groups from consecutive ranks (ds-parallel's mesh), so the given group must
  hold the ranks the mesh gives this rank; a group of other ranks is refused, naming both.

Every conflict raises ValueError (the config ones `DeepSpeedConfigError`, a ValueError too) on every
rank before any group is built. The record is consumed by the initialize() that reads it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ds_comm
from ds_engine._optional import require
from ds_engine.config import DeepSpeedConfigError

__all__ = [
    "TpInitRecord",
    "check_given_group",
    "merge_tp_model_init",
    "recorded_tp_size",
    "refuse_group_with_mpu",
    "tp_group_ranks",
    "tp_model_init",
]

_RECORD: dict[str, Any] = {}


def tp_model_init(model: nn.Module, tp_size: int, dtype: torch.dtype, config: Any = None, **kwargs: Any) -> nn.Module:
    """Record tensor-parallel arguments for the next initialize() and switch AutoTP to training mode.

    Args:
        model: returned unchanged (initialize() shards it).
        tp_size: the tensor-parallel degree (a positive int).
        dtype: the training dtype the config must agree with.
        config: accepted for DeepSpeed's signature; the config is read by initialize().
        **kwargs: `tp_group`, the tensor-parallel group (then initialize() must not get an mpu).

    Raises:
        ValueError: `tp_size` is not a positive int, or a second call disagrees with the first.
    """
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"tp_model_init: tp_size must be a positive int, got {tp_size!r}")
    tp_group = kwargs.get("tp_group")
    new = {"tp_size": tp_size, "dtype": dtype, "tp_group": tp_group}
    if _RECORD:
        old_group, same_group_kind = _RECORD["tp_group"], (_RECORD["tp_group"] is None) == (tp_group is None)
        if (
            _RECORD["tp_size"] != tp_size
            or _RECORD["dtype"] != dtype
            or not same_group_kind
            or (tp_group is not None and tp_group_ranks(old_group) != tp_group_ranks(tp_group))
        ):
            raise ValueError(
                f"tp_model_init: conflicting arguments across calls (first tp_size={_RECORD['tp_size']}, "
                f"dtype={_RECORD['dtype']}, tp_group given={old_group is not None}; now tp_size={tp_size}, "
                f"dtype={dtype}, tp_group given={tp_group is not None})"
            )
    _RECORD.update(new)
    require("ds_parallel", extra="parallel", feature="tp_model_init").tensor.set_autotp_mode(training=True)
    return model


def tp_group_ranks(group: Any) -> tuple[int, ...]:
    """The global ranks of `group` (empty when this process is not in it)."""
    try:
        return tuple(torch.distributed.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return ()


class TpInitRecord:
    """What initialize() takes from the record: the degree, and the group the user gave (if any)."""

    def __init__(self, size: int, tp_group: Any) -> None:
        self.size = size
        self.tp_group = tp_group


def _config_dtype(config: Any) -> torch.dtype | None:
    if config.bfloat16_enabled:
        return torch.bfloat16
    if config.fp16_enabled:
        return torch.float16
    return None


def recorded_tp_size() -> int | None:
    """The size the pending record holds (None: no record), without consuming it: initialize() reads the
    degrees before the config is validated, and merges the record after."""
    size = _RECORD.get("tp_size")
    return None if size is None else int(size)


def refuse_group_with_mpu(mpu: Any) -> None:
    """Called first in initialize(): a recorded `tp_group` and an `mpu=` are two sources of groups.

    Raises:
        ValueError: both are given (the record is dropped, as the failed initialize() consumes it).
    """
    if mpu is not None and _RECORD.get("tp_group") is not None:
        _RECORD.clear()
        raise ValueError("tp_model_init provided tp_group; deepspeed.initialize must not receive mpu.")


def merge_tp_model_init(config: Any) -> TpInitRecord:
    """The tensor-parallel degree and group for this initialize(): the config's, filled from `tp_model_init`.

    Consumes the record.

    Raises:
        DeepSpeedConfigError: `autotp_size` or `tp.tp_size` disagree with each other or with the record.
        ValueError: a dtype disagrees with the record, or a recorded `tp_group` is not `tp_size` ranks.
    """
    record = dict(_RECORD)
    _RECORD.clear()
    section = config.parsed.tensor_parallel
    size = section.autotp_size
    recorded = record.get("tp_size")
    if recorded is not None and size not in (0, recorded):
        raise DeepSpeedConfigError(
            f"tensor_parallel.autotp_size={size} but tp_model_init recorded tp_size={recorded}; make them agree"
        )
    size = int(size or recorded or 0)
    if section.tensor_parallel.tp_size not in (1, size):
        raise DeepSpeedConfigError(
            f"tensor_parallel.tp.tp_size={section.tensor_parallel.tp_size} does not match "
            f"tensor_parallel.autotp_size={size}"
        )
    if recorded is None:
        return TpInitRecord(size, None)
    dtype, tp_group = record["dtype"], record["tp_group"]
    in_config = _config_dtype(config)
    if in_config is not None and in_config != dtype:
        raise ValueError(f"Conflicting dtype: config uses {in_config} but tp_model_init requested {dtype}.")
    explicit = config.raw.get("tensor_parallel", {}).get("dtype")
    if explicit is not None and section.dtype != dtype:
        raise ValueError(f"Conflicting tensor_parallel.dtype in config ({explicit}) and tp_model_init ({dtype}).")
    if tp_group is not None and ds_comm.is_initialized():
        group_size = ds_comm.get_world_size(tp_group)
        if group_size != recorded:
            raise ValueError(f"tp_model_init tp_size ({recorded}) does not match tp_group size ({group_size}).")
    return TpInitRecord(size, tp_group)


def check_given_group(tp_group: Any, mesh_group: Any) -> None:
    """Refuse a `tp_model_init(tp_group=...)` whose ranks differ from the mesh's tensor-parallel group."""
    given, built = tp_group_ranks(tp_group), tp_group_ranks(mesh_group)
    if given != built:
        raise ValueError(
            f"tp_model_init(tp_group=...): the group holds ranks {list(given)}, but ds builds tensor-parallel groups "
            f"of consecutive ranks and rank {ds_comm.get_rank()}'s is {list(built)}; pass a group of those ranks "
            "(or none: initialize() builds it)"
        )
