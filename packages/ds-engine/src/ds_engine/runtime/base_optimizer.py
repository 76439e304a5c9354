"""`deepspeed.runtime.base_optimizer.DeepSpeedOptimizer`: "is this one of DeepSpeed's optimizer wrappers?".

Lightning Fabric's DeepSpeed `load_checkpoint` looks for `isinstance(obj, (Optimizer, DeepSpeedOptimizer))`
in the state it is given. In ds the wrappers are ds-engine's `MixedPrecisionOptimizer` (fp16/bf16) and
ds-zero's ZeRO optimizers (stages 1-2 and 3); they answer True here without sharing a base class (an
abstract base with a subclass hook). ds-zero is only consulted when it is already imported: a ZeRO
optimizer cannot exist otherwise.
"""

from __future__ import annotations

import abc
import sys
from typing import Any

from ds_engine._step.precision import MixedPrecisionOptimizer

__all__ = ["DeepSpeedOptimizer", "ZeROOptimizer"]

_ZERO_WRAPPERS = ("DeepSpeedZeroOptimizer", "DeepSpeedZeroOptimizer_Stage3")


def _zero_classes() -> tuple[type, ...]:
    ds_zero = sys.modules.get("ds_zero")
    return tuple(getattr(ds_zero, name) for name in _ZERO_WRAPPERS) if ds_zero is not None else ()


def _wrapper_classes() -> tuple[type, ...]:
    return (MixedPrecisionOptimizer, *_zero_classes())


class DeepSpeedOptimizer(abc.ABC):  # noqa: B024 - a type to test against, nothing to implement
    """True for ds's optimizer wrappers (`isinstance(engine.optimizer, DeepSpeedOptimizer)`)."""

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        if cls is DeepSpeedOptimizer:
            return True if issubclass(other, _wrapper_classes()) else NotImplemented
        return NotImplemented


class ZeROOptimizer(DeepSpeedOptimizer):
    """True for ds-zero's ZeRO optimizers (stages 1-3)."""

    @classmethod
    def __subclasshook__(cls, other: type) -> Any:
        if cls is ZeROOptimizer:
            zero = _zero_classes()
            return True if zero and issubclass(other, zero) else NotImplemented
        return NotImplemented
