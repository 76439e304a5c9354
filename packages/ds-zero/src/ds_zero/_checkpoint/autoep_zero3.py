"""Refuse to consolidate an AutoEP checkpoint saved at ZeRO stage 3 over the data-parallel ranks (`zero_to_fp32`).

Such a checkpoint's expert tensors are partitioned over their expert-data-parallel groups, and different
expert-parallel ranks hold different experts: the per-rank partition files do not add up to whole
parameters the way `zero_to_fp32` and the universal converter assume. The engine marks the model-states
file's AutoEP layer entries (`ds_autoep_layers`) with DeepSpeed's `checkpoint_format: "zero3_partitioned"`;
`zero_to_fp32` refuses them, as DeepSpeed 0.19.8's does. The universal converter takes them: it rebuilds each
expert range from its own fragments and joins the ranges (`universal_autoep.py`). The engine loads such a save
as it is at any world size and `autoep_size` (`expert_ranges.py`); the save writes no per-expert files, as
DeepSpeed's does not.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

__all__ = ["AutoEPZero3CheckpointError", "is_autoep_zero3", "refuse_autoep_zero3"]

_LAYERS_KEYS = ("ds_autoep_layers", "autoep_layers")
_FORMAT_KEY = "checkpoint_format"
_ZERO3_FORMAT = "zero3_partitioned"


class AutoEPZero3CheckpointError(NotImplementedError, ValueError):
    """A data-parallel consolidation of an AutoEP ZeRO-3 checkpoint (NotImplementedError, as DeepSpeed's)."""


def is_autoep_zero3(states: Mapping[str, Any]) -> bool:
    """Whether a model-states dict holds AutoEP layers whose experts live in ZeRO-3 expert partitions."""
    for key in _LAYERS_KEYS:
        entries = states.get(key) or []
        if any(isinstance(e, Mapping) and e.get(_FORMAT_KEY) == _ZERO3_FORMAT for e in entries):
            return True
    return False


def refuse_autoep_zero3(
    states: Mapping[str, Any], path: str | os.PathLike[str] | None, what: str = "zero_to_fp32"
) -> None:
    """Raise when `states` (read from `path`) is an AutoEP ZeRO-3 save (see the module docstring).

    Raises:
        AutoEPZero3CheckpointError: it is.
    """
    if is_autoep_zero3(states):
        raise AutoEPZero3CheckpointError(
            f"{what}: {path} is an AutoEP checkpoint saved at ZeRO stage 3 (ds_autoep_layers checkpoint_format "
            f"{_ZERO3_FORMAT!r}); its expert tensors are partitioned over expert-data-parallel groups, so a "
            "data-parallel consolidation would mix different ranks' experts (DeepSpeed refuses it too). Convert it "
            "with ds_to_universal.py (the `ds_to_universal` command; it joins every expert tensor whole) and load "
            "that with checkpoint.load_universal, at any world size and autoep_size; ds's engine also loads the save "
            "as it is at any world size and autoep_size (engine.load_checkpoint)"
        )
