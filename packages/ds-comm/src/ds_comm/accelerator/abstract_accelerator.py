"""`deepspeed.accelerator.abstract_accelerator`: the interface every accelerator implements, by DeepSpeed's name."""

from __future__ import annotations

from ds_comm.accelerator._abstract import Accelerator as DeepSpeedAccelerator

__all__ = ["DeepSpeedAccelerator"]
