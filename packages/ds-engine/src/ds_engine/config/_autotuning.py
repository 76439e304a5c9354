"""The `autotuning` section: DeepSpeed 0.19.8's keys and defaults, read by the engine and by the autotuner.

ds-launcher's autotuner reads the same section with its own model (`ds_launcher.autotuning.config`;
ds-launcher does not depend on ds-engine); a test in the `deepspeed` distribution keeps the two key
sets and defaults equal.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from ds_comm import ConfigModel
from ds_engine.config._types import NonNegInt, PosInt

__all__ = ["AutotuningConfig", "AutotuningModelInfo"]


class AutotuningModelInfo(ConfigModel):
    """`autotuning.model_info`: what the autotuner knows of the model (measured by a profile run when absent)."""

    profile: bool = False
    """Measure the model (parameter count, activation memory of one forward) and exit after the first forward."""
    num_params: NonNegInt | None = None
    hidden_size: NonNegInt | None = None
    num_layers: NonNegInt | None = None


class AutotuningConfig(ConfigModel):
    """`autotuning`: DeepSpeed's autotuner (`deepspeed --autotuning tune|run`, ds-launcher's `autotuning`).

    The engine's part is the experiment: with `enabled`, it times the optimizer steps
    `start_profile_step..end_profile_step` (counted from 0), writes the metrics JSON to `metric_path`
    (rank 0) and ends the process with status 0 after step `end_profile_step`; with `model_info.profile`
    it writes the model's size and the activation memory of one forward to `model_info_path` and ends
    after the first forward. The search keys (`tuner_*`, `*_micro_batch_size*`, ...) are the launcher's.
    """

    enabled: bool = False
    """Run as an autotuning experiment: profile the steps above, write the metrics, exit."""
    fast: bool = True
    """Tune ZeRO stage and micro-batch size only (false: also the stage's ZeRO knobs)."""
    results_dir: str = "autotuning_results"
    exps_dir: str = "autotuning_exps"
    overwrite: bool = True
    start_profile_step: NonNegInt = 3
    """First optimizer step timed (steps before it warm up)."""
    end_profile_step: NonNegInt = 5
    """Last optimizer step timed; the experiment exits after it."""
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    metric_path: str | None = None
    """Where the metrics JSON goes (None: `autotuning_metric.json` in the working directory)."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: PosInt = 5
    tuner_num_trials: PosInt = 50
    arg_mappings: dict[str, str] | None = None
    model_info: AutotuningModelInfo | None = None
    model_info_path: str | None = None
    """Where `model_info.profile` writes (None: `autotuning_model_info.json` in the working directory)."""
    mp_size: PosInt = 1
    max_train_batch_size: PosInt | None = None
    min_train_batch_size: PosInt = 1
    max_train_micro_batch_size_per_gpu: PosInt = 1024
    min_train_micro_batch_size_per_gpu: PosInt = 1
    num_tuning_micro_batch_sizes: PosInt = 3

    @model_validator(mode="after")
    def _profile_window(self) -> AutotuningConfig:
        if self.end_profile_step < self.start_profile_step:
            raise ValueError(
                f"end_profile_step={self.end_profile_step} is before start_profile_step={self.start_profile_step}; "
                "the timed steps are start_profile_step..end_profile_step"
            )
        if self.min_train_micro_batch_size_per_gpu > self.max_train_micro_batch_size_per_gpu:
            raise ValueError(
                f"min_train_micro_batch_size_per_gpu={self.min_train_micro_batch_size_per_gpu} is above "
                f"max_train_micro_batch_size_per_gpu={self.max_train_micro_batch_size_per_gpu}"
            )
        return self

    def describe(self) -> list[str]:
        """What an experiment engine does, for `explain`."""
        lines = [
            f"optimizer steps {self.start_profile_step}..{self.end_profile_step} timed; the {self.metric} "
            f"metrics written to {self.metric_path or 'autotuning_metric.json'} by rank 0; the process "
            f"exits (status 0) after step {self.end_profile_step}"
        ]
        if self.model_info is not None and self.model_info.profile:
            lines = [
                "model profile: parameter count and the activation memory of one forward written to "
                f"{self.model_info_path or 'autotuning_model_info.json'}; the process exits after the first forward"
            ]
        return lines
