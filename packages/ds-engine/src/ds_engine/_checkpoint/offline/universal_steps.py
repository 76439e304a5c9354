"""The checks DeepSpeed's `ds_to_universal.main` makes before it converts, one small step each.

They are separate module-level functions in DeepSpeed (tools and tests replace them one at a time), so
they are here under its names, and `ds_to_universal.main` calls them through its own module globals:
which optimizer-state files a tag directory holds, which of those are ZeRO partitions, the ZeRO stage
they record, DeepSpeed's `--inject_missing_state` default `universal_checkpoint_info`, and the refusal
of parameters whose AutoTP cut cannot be described (`autotp_unsupported_parameter_patterns`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ds_comm
from ds_engine._checkpoint.constants import (
    AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS,
    OPTIMIZER_STATE_DICT,
    UNIVERSAL_CHECKPOINT_INFO,
    UNIVERSAL_CHECKPOINT_VERSION_KEY,
    UNIVERSAL_CHECKPOINT_VERSION_VALUE,
    ZERO_STAGE,
)

__all__ = [
    "MissingUniversalInfoError",
    "_check_for_required_state",
    "_filter_zero3_optim_files",
    "_get_optim_files",
    "_get_zero_stage",
    "_inject_missing_state",
    "_validate_autotp_conversion_support",
]

_ZERO_FILE = re.compile(r"(?:bf16_|fp16_)?zero_pp_rank_")


class MissingUniversalInfoError(AssertionError, ValueError):
    """A ZeRO-1/2 checkpoint without `universal_checkpoint_info` (DeepSpeed asserts it; it is bad input)."""


def _natural_key(path: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path)]


def _get_optim_files(checkpoint_dir: str | os.PathLike[str]) -> list[str]:
    """Every `*_optim_states.pt` in `checkpoint_dir`, in natural order (rank 10 after rank 9).

    Raises:
        FileNotFoundError: none there.
    """
    files = sorted((str(p) for p in Path(checkpoint_dir).glob("*_optim_states.pt")), key=_natural_key)
    if not files:
        raise FileNotFoundError(f"no *_optim_states.pt files in {checkpoint_dir}: not a ZeRO checkpoint tag directory")
    return files


def _filter_zero3_optim_files(optim_files: Sequence[str]) -> list[str]:
    """The ZeRO partition files (`[bf16_|fp16_]zero_pp_rank_*`) among `optim_files`."""
    return [f for f in optim_files if _ZERO_FILE.match(os.path.basename(f))]


def _get_zero_stage(optim_files: Sequence[str]) -> int:
    """The ZeRO stage the first file records (1 when it records none, as DeepSpeed assumes)."""
    state = ds_comm.load_checkpoint_file(optim_files[0])
    return int(state[OPTIMIZER_STATE_DICT].get(ZERO_STAGE, 1))


def _inject_missing_state(ds_checkpoint: Any) -> None:
    """Give a checkpoint without `universal_checkpoint_info` the default one (only the version)."""
    if ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO) is None:
        ds_checkpoint.global_state[UNIVERSAL_CHECKPOINT_INFO] = {
            UNIVERSAL_CHECKPOINT_VERSION_KEY: UNIVERSAL_CHECKPOINT_VERSION_VALUE
        }


def _check_for_required_state(ds_checkpoint: Any) -> None:
    """The checkpoint has `universal_checkpoint_info`, and it marks no parameter unconvertible.

    Raises:
        MissingUniversalInfoError: it has none (pass `inject_missing_state` for an engine's checkpoint).
        ValueError: parameters the saving AutoTP marked unconvertible.
    """
    info = ds_checkpoint.get_checkpoint_info(UNIVERSAL_CHECKPOINT_INFO)
    if info is None:
        raise MissingUniversalInfoError(
            f"the checkpoint has no {UNIVERSAL_CHECKPOINT_INFO!r}: pass --inject_missing_state to convert an engine "
            "checkpoint with the defaults, or save it from a client that records it"
        )
    _validate_autotp_conversion_support(info)


def _validate_autotp_conversion_support(universal_checkpoint_info: Mapping[str, Any]) -> None:
    """Refuse the parameters the saving AutoTP marked unconvertible (pattern: reason), naming each.

    Raises:
        ValueError: there are such parameters.
    """
    unsupported = dict(universal_checkpoint_info.get(AUTOTP_UNSUPPORTED_PARAMETER_PATTERNS) or {})
    if unsupported:
        details = ", ".join(f"{pattern}: {why}" for pattern, why in sorted(unsupported.items()))
        raise ValueError(f"AutoTP universal checkpoint conversion is not supported for {details}")
