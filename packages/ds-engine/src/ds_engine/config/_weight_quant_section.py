"""`weight_quantization`: validated by ds-zero's `WeightQuantizationConfig` (ZeRO-Inference quantized init).

The section is read by `zero.Init` (ds-zero), which quantizes the `nn.Linear` / `nn.Embedding` weights it
builds when `quantized_initialization` is set; the engine only validates it, so a bad or unsupported key
(`post_init_quant`) is refused by key path before anything is built.
"""

from __future__ import annotations

from typing import Any

from ds_comm import ConfigError, validate_section, warn_ignored
from ds_engine._optional import require
from ds_engine.config._errors import DeepSpeedConfigError

__all__ = ["resolve_weight_quantization"]


def resolve_weight_quantization(value: dict[str, Any] | None) -> Any:
    """ds-zero's `WeightQuantizationConfig` for the section, or None when it is absent.

    Raises:
        DeepSpeedConfigError: anything ds-zero's model refuses, or ds-zero is not installed.
    """
    if value is None:
        return None
    try:
        ds_zero = require("ds_zero", extra="zero", feature="weight_quantization (quantized zero.Init)")
    except ImportError as err:
        raise DeepSpeedConfigError(f"weight_quantization: {err}") from None
    try:
        section = validate_section(ds_zero.WeightQuantizationConfig, value, path="weight_quantization")
    except ConfigError as err:
        raise DeepSpeedConfigError(str(err).replace("Value error, ", "")) from None
    warn_ignored(section, path="weight_quantization")
    return section
