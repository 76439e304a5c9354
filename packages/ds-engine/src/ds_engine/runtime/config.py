"""`deepspeed.runtime.config`: `DeepSpeedConfig` (a ds_config validated and resolved) and its error type.

`DeepSpeedConfig(config_dict_or_path)` is what DeepSpeed's tools and tests build to read a config's
sections (`.monitor_config`, `.zero_config`, `.train_batch_size`...) without an engine.
"""

from __future__ import annotations

from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]
