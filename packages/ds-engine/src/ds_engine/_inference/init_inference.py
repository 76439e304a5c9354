"""`init_inference()`: DeepSpeed's entry point for inference, merging a config and keyword arguments."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ds_engine._inference.engine import InferenceEngine

__all__ = ["init_inference"]


def init_inference(
    model: nn.Module, config: str | os.PathLike[str] | dict[str, Any] | None = None, **kwargs: Any
) -> InferenceEngine:
    """Prepare `model` for inference: dtype, automatic tensor parallelism, checkpoint, device.

    `config` (a dict or a JSON file) and `kwargs` are merged; a key in both must have the same value.
    The merged settings are `DeepSpeedInferenceConfig` (DeepSpeed's keys: `dtype`, `tensor_parallel`
    {"tp_size": N}, `replace_with_kernel_inject`, `checkpoint`, `injection_policy`, ...). With
    `tp_size` > 1 the process group is created if needed (launcher environment) and the model's linear
    layers are sharded over consecutive groups of `tp_size` ranks (needs ds-parallel, the `parallel` extra).
    A key set to anything but its default that has no effect here (one only DeepSpeed's injected kernels
    read, `triangular_masking`...) gives one warning naming it.

    Args:
        model: the original module, without wrappers.
        config: a dict or the path of a JSON file; None: defaults.
        **kwargs: config keys (taking part in the merge as described).

    Returns:
        the `InferenceEngine` wrapping the (sharded) model.

    Raises:
        ValueError: `config` of another type, a key given in both with different values, or any invalid
            setting (a `ConfigError` naming the key; `replace_with_kernel_inject=True` is refused).
    """
    from ds_comm import validate_section, warn_ignored
    from ds_engine._inference.config import DeepSpeedInferenceConfig
    from ds_engine._inference.engine import InferenceEngine

    if config is None:
        config_dict: dict[str, Any] = {}
    elif isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config_dict = json.load(f)
    elif isinstance(config, dict):
        config_dict = dict(config)
    else:
        raise ValueError(f"init_inference: 'config' must be a path or a dict, got {type(config).__name__}")
    for key in set(config_dict) & set(kwargs):
        if config_dict[key] != kwargs[key]:
            raise ValueError(f"Conflicting argument '{key}' in 'config':{config_dict[key]} and kwargs:{kwargs[key]}")
    config_dict.update(kwargs)
    settings = validate_section(DeepSpeedInferenceConfig, config_dict)
    warn_ignored(settings)
    return InferenceEngine(model, settings)
