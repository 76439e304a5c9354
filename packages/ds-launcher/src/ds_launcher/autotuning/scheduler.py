"""DeepSpeed's `deepspeed.autotuning.scheduler`: launching the experiments (`ResourceManager`)."""

from __future__ import annotations

from ds_launcher._autotuning.scheduler import ExperimentResult, ExperimentScheduler

#: DeepSpeed's name for the object that runs the experiments.
ResourceManager = ExperimentScheduler

__all__ = ["ExperimentResult", "ExperimentScheduler", "ResourceManager"]
