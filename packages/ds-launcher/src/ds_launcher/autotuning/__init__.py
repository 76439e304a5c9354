"""DeepSpeed's `deepspeed.autotuning` package: the autotuner behind `deepspeed --autotuning tune|run`.

The implementation is ds-launcher's `_autotuning` package; these modules keep DeepSpeed 0.19.8's paths.
"""

from __future__ import annotations

from ds_launcher._autotuning.autotuner import Autotuner

__all__ = ["Autotuner"]
