"""`deepspeed.inference`: `InferenceEngine` and `DeepSpeedInferenceConfig` (built by `init_inference`)."""

from __future__ import annotations

from ds_engine.inference.config import DeepSpeedInferenceConfig, DeepSpeedTPConfig
from ds_engine.inference.engine import InferenceEngine

__all__ = ["DeepSpeedInferenceConfig", "DeepSpeedTPConfig", "InferenceEngine"]
