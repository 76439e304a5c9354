"""DeepSpeed's `deepspeed.autotuning.autotuner`."""

from __future__ import annotations

from ds_launcher._autotuning.autotuner import Autotuner, run_autotuning

__all__ = ["Autotuner", "run_autotuning"]
