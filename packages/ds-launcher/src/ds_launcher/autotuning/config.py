"""DeepSpeed's `deepspeed.autotuning.config`: the `autotuning` section as the autotuner reads it."""

from __future__ import annotations

from typing import Any

from ds_launcher._autotuning.settings import AutotuningModelInfo, AutotuningSettings, read_settings

__all__ = ["AutotuningModelInfo", "AutotuningSettings", "DeepSpeedAutotuningConfig"]


def DeepSpeedAutotuningConfig(param_dict: dict[str, Any] | None) -> AutotuningSettings:  # noqa: N802 - DeepSpeed's name
    """DeepSpeed's constructor: the `autotuning` section of a whole ds_config (defaults when absent)."""
    return read_settings(param_dict or {})
