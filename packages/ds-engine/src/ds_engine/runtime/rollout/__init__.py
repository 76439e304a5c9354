"""`deepspeed.runtime.rollout`: on-policy generation for RL and distillation trainers.

The interface (`RolloutEngine`, `RolloutRequest` / `RolloutBatch` / `SamplingConfig`, `RolloutConfig`) is in
`base`; `HybridEngineRollout` generates with the engine being trained; `build_rollout(cfg, student_engine,
tokenizer)` picks the backend named by `cfg.engine` ("hybrid_engine", the only one).
"""

from __future__ import annotations

from typing import Any

from ds_engine.runtime.rollout.base import RolloutBatch, RolloutConfig, RolloutEngine, RolloutRequest, SamplingConfig
from ds_engine.runtime.rollout.hybrid_engine_rollout import HybridEngineRollout, HybridEngineRolloutConfig

__all__ = [
    "HybridEngineRollout",
    "HybridEngineRolloutConfig",
    "RolloutBatch",
    "RolloutConfig",
    "RolloutEngine",
    "RolloutRequest",
    "SamplingConfig",
    "build_rollout",
]


def build_rollout(rollout_cfg: Any, student_engine: Any = None, tokenizer: Any = None) -> RolloutEngine:
    """The rollout backend `rollout_cfg.engine` names, over `student_engine` and `tokenizer`.

    Raises:
        ValueError: an unknown engine name, or "hybrid_engine" without an engine and a tokenizer.
    """
    name = getattr(rollout_cfg, "engine", None)
    if name == "hybrid_engine":
        if student_engine is None or tokenizer is None:
            raise ValueError("build_rollout: the hybrid_engine rollout needs both student_engine and tokenizer")
        return HybridEngineRollout(student_engine, tokenizer, cfg=rollout_cfg)
    raise ValueError(f"build_rollout: Unknown rollout engine {name!r}; choose 'hybrid_engine'")
