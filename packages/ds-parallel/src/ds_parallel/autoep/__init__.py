"""AutoEP: expert parallelism for a Hugging Face MoE model without changing the model's code."""

from __future__ import annotations

from ds_parallel.autoep._convert import (
    AutoEPOptions,
    ConversionReport,
    apply_overrides,
    convert_moe_model,
    detect_moe_layers,
)
from ds_parallel.autoep._experts import EXPERT_ACTIVATIONS, GroupedExperts
from ds_parallel.autoep._layer import AutoEPMoELayer, MoELayerSpec
from ds_parallel.autoep._presets import PRESETS, MoEModelPreset, preset_for_model_type
from ds_parallel.autoep._router import TopKRouter

__all__ = [
    "EXPERT_ACTIVATIONS",
    "PRESETS",
    "AutoEPMoELayer",
    "AutoEPOptions",
    "ConversionReport",
    "GroupedExperts",
    "MoELayerSpec",
    "MoEModelPreset",
    "TopKRouter",
    "apply_overrides",
    "convert_moe_model",
    "detect_moe_layers",
    "preset_for_model_type",
]
