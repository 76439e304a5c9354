"""DeepSpeed's `deepspeed.autotuning.tuner.base_tuner`."""

from __future__ import annotations

from ds_launcher._autotuning.tuners import Trial, Tuner

#: DeepSpeed's name for the tuners' base class.
BaseTuner = Tuner

__all__ = ["BaseTuner", "Trial"]
