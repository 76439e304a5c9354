"""The `autotuning` section as the autotuner reads it, and the user's ds_config found in the script's arguments.

The keys and defaults are DeepSpeed 0.19.8's. ds-engine validates the same section in every
experiment's config with its own model (ds-launcher does not depend on ds-engine); a test in the
`deepspeed` distribution keeps the two in step. Every bad value is refused here, naming its key path,
before the first experiment starts.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from ds_comm import ConfigError, ConfigModel, validate_section

logger = logging.getLogger(__name__)

__all__ = [
    "AutotuningModelInfo",
    "AutotuningSettings",
    "UserConfig",
    "find_user_config",
    "read_settings",
]


class AutotuningModelInfo(ConfigModel):
    """`autotuning.model_info`: the model's size, when known (saves the profile run)."""

    profile: bool = False
    num_params: int | None = Field(default=None, ge=0)
    hidden_size: int | None = Field(default=None, ge=0)
    num_layers: int | None = Field(default=None, ge=0)


class AutotuningSettings(ConfigModel):
    """`autotuning`: what the autotuner searches and how (DeepSpeed's keys and defaults)."""

    enabled: bool = False
    """Read by the engine (an experiment's config always has it on); the tuner runs whatever it says."""
    fast: bool = True
    """Search ZeRO stage x micro-batch size only; false: also each stage's ZeRO knobs."""
    results_dir: str = Field(default="autotuning_results", min_length=1)
    """One folder per experiment, plus `summary.txt`, `ds_config_optimal.json`, `cmd_optimal.txt`."""
    exps_dir: str = Field(default="autotuning_exps", min_length=1)
    """One `<experiment>.json` description per experiment."""
    overwrite: bool = True
    """Remove earlier results first; false: an experiment whose results exist is read back, not rerun."""
    start_profile_step: int = Field(default=3, ge=0)
    end_profile_step: int = Field(default=5, ge=0)
    metric: Literal["throughput", "latency", "flops"] = "throughput"
    """What the tuner optimizes: samples/s and flops/s up, ms per step down."""
    metric_path: str | None = None
    """Set per experiment by the autotuner."""
    tuner_type: Literal["gridsearch", "random", "model_based"] = "gridsearch"
    tuner_early_stopping: int = Field(default=5, gt=0)
    """Stop after this many experiments in a row without a better metric."""
    tuner_num_trials: int = Field(default=50, gt=0)
    """At most this many tuning experiments."""
    arg_mappings: dict[str, str] | None = None
    """ds_config key -> the script's argument that carries it (for configs with "auto" values)."""
    model_info: AutotuningModelInfo | None = None
    model_info_path: str | None = None
    mp_size: int = Field(default=1, gt=0)
    """Model-parallel degree: ranks per data-parallel replica."""
    max_train_batch_size: int | None = Field(default=None, gt=0)
    min_train_batch_size: int = Field(default=1, gt=0)
    max_train_micro_batch_size_per_gpu: int = Field(default=1024, gt=0)
    min_train_micro_batch_size_per_gpu: int = Field(default=1, gt=0)
    num_tuning_micro_batch_sizes: int = Field(default=3, gt=0)

    @model_validator(mode="after")
    def _ranges(self) -> AutotuningSettings:
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

    @property
    def higher_is_better(self) -> bool:
        """Throughput and flops grow with speed; latency shrinks."""
        return self.metric != "latency"


def read_settings(ds_config: dict[str, Any]) -> AutotuningSettings:
    """The `autotuning` section of `ds_config` (its defaults when absent).

    Raises:
        ConfigError: a bad key or value, named by its path (`autotuning.tuner_type: ...`).
    """
    section = ds_config.get("autotuning")
    if section is None:
        return AutotuningSettings()
    if not isinstance(section, dict):
        raise ConfigError(f"autotuning: must be a JSON object, got {type(section).__name__}")
    return validate_section(AutotuningSettings, section, path="autotuning")


class UserConfig:
    """The training script's ds_config and where its path sits in the script's arguments.

    Args:
        path: the config file.
        config: its parsed content.
        arg_index: index in the script's arguments of the value to replace with an experiment's config.
    """

    def __init__(self, path: Path, config: dict[str, Any], arg_index: int) -> None:
        self.path = path
        self.config = config
        self.arg_index = arg_index

    def args_with(self, user_args: Sequence[str], config_path: str | Path) -> list[str]:
        """The script's arguments with the config path replaced by `config_path`."""
        args = list(user_args)
        if args[self.arg_index].startswith("--"):  # `--deepspeed_config=path`
            flag = args[self.arg_index].partition("=")[0]
            args[self.arg_index] = f"{flag}={config_path}"
        else:
            args[self.arg_index] = str(config_path)
        return args


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ConfigError(f"{key}: the key appears twice in the ds_config; keep one")
        out[key] = value
    return out


def find_user_config(user_args: Sequence[str]) -> UserConfig:
    """The ds_config the script is given: `--deepspeed_config PATH` (or `=PATH`), else `--deepspeed PATH.json`.

    Raises:
        ValueError: no config among the arguments, or the file is missing or not a JSON object.
    """
    args = list(user_args)
    index = None
    for i, arg in enumerate(args):
        if arg == "--deepspeed_config" and i + 1 < len(args):
            index = i + 1
            break
        if arg.startswith("--deepspeed_config="):
            index = i
            break
    if index is None:
        for i, arg in enumerate(args[:-1]):
            if arg == "--deepspeed" and args[i + 1].endswith(".json"):
                index = i + 1
                break
    if index is None:
        raise ValueError(
            "--autotuning needs the training script's ds_config: pass it to the script as "
            "--deepspeed_config ds_config.json (or --deepspeed ds_config.json)"
        )
    value = args[index].partition("=")[2] if args[index].startswith("--") else args[index]
    path = Path(value)
    if not path.is_file():
        raise ValueError(f"--deepspeed_config {value}: no such file")
    try:
        config = json.loads(path.read_text(), object_pairs_hook=_no_duplicates)
    except json.JSONDecodeError as err:
        raise ValueError(f"--deepspeed_config {value}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed_config {value}: the ds_config must be a JSON object")
    return UserConfig(path, config, index)
