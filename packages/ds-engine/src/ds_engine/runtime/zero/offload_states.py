"""`deepspeed.runtime.zero.offload_states`: where each kind of training state is, around `offload_states()`.

`get_state_devices(model, state)` answers for an engine what RLHF loops check between
`engine.offload_states()` and `engine.reload_states()`: the set of devices the bytes of one kind of state
(`OffloadStateTypeEnum`) are on. The engine (and under ZeRO its optimizer) knows which tensors hold each
kind and where `offload_states()` put them; this module is DeepSpeed's path to that answer.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ds_ops import OffloadStateTypeEnum

__all__ = ["get_state_devices"]


class _ReportsStateDevices(Protocol):
    def state_devices(self, state: OffloadStateTypeEnum | str) -> set[torch.device]: ...


def get_state_devices(model: _ReportsStateDevices, state: OffloadStateTypeEnum | str) -> set[torch.device]:
    """The devices the bytes of `state` are on now, for a `DeepSpeedEngine` (`model`).

    An offloaded state counts on the device of its host copy; gradient memory that `offload_states()`
    released (it comes back zero-filled) and a state that holds nothing now (no gradients after a step)
    give an empty set. Not a collective: each rank reports its own partition.

    Args:
        model: the engine returned by `initialize()`.
        state: the kind of state (an `OffloadStateTypeEnum` member or its name).

    Raises:
        TypeError: `model` is not an engine (it has no `state_devices`).
        ValueError: `state` is not an `OffloadStateTypeEnum` name.
        RuntimeError: the engine has no optimizer.
    """
    report = getattr(model, "state_devices", None)
    if report is None:
        raise TypeError(
            f"get_state_devices(model=...) needs the engine deepspeed.initialize() returned, got {type(model).__name__}"
        )
    return report(state)
