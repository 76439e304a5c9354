"""`deepspeed.runtime` for migrated scripts: DeepSpeed's module paths under `runtime`.

`runtime.lr_schedules` (ds-engine's schedules), `runtime.pipe` (with `.topology`, `.schedule`,
`.module`; ds-pipe, the `pipe` extra), `runtime.activation_checkpointing.checkpointing` (ds-pipe) and
`runtime.zero` (with `.partition_parameters`; ds-zero, the `zero` extra),
`runtime.sequence_parallel` (`.ulysses_sp`, `.parallel_state_sp`; ds-parallel, the `parallel` extra),
`runtime.utils` (DeepSpeed's helpers: `move_to_device`, `see_memory_usage`, `clip_grad_norm_`...),
`runtime.checkpoint_engine` (`TorchCheckpointEngine`, what `engine.checkpoint_engine` is),
`runtime.dataloader` (`RepeatingLoader`), `runtime.data_pipeline.data_sampling` (indexed datasets, the data
analyzer, the curriculum sampler, dynamic batching), `runtime.hybrid_engine` (`DeepSpeedHybridEngine`),
`runtime.tensor_parallel` (`TpTrainingManager`, the `tensor_parallel` section's models; AutoTP from
ds-parallel, the `parallel` extra), `runtime.config` (`DeepSpeedConfig`), `runtime.fp16` and
`runtime.bf16_optimizer` (the 16-bit wrapper and loss scalers under DeepSpeed's class names),
`runtime.precision_config` (the `fp16`/`bf16` section models) and `runtime.config_utils`
(`DeepSpeedConfigModel`, the base of config classes written against DeepSpeed), `runtime.rollout`
(on-policy generation for RL trainers: `RolloutEngine`, `HybridEngineRollout`, `build_rollout`),
`runtime.zenflow` (`zenflow_config.ZenFlowConfig`, ds-zero's; `zenflow_utils._split_affinity`),
`runtime.engine` (`DeepSpeedEngine`), `runtime.base_optimizer`, `runtime.constants`, `runtime.comm`,
`runtime.swap_tensor`, `runtime.torch_autocast` and `runtime.data_pipeline` (curriculum schedules, random-LTD).
Every one is an attribute of `deepspeed.runtime` (DeepSpeed's tests patch `deepspeed.runtime.engine...`
without importing it) and is imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

from ds_engine.runtime import lr_schedules

if TYPE_CHECKING:  # type checkers see the lazy submodules
    from ds_engine.runtime import activation_checkpointing as activation_checkpointing
    from ds_engine.runtime import dataloader as dataloader
    from ds_engine.runtime import engine as engine
    from ds_engine.runtime import hybrid_engine as hybrid_engine
    from ds_engine.runtime import pipe as pipe
    from ds_engine.runtime import sequence_parallel as sequence_parallel
    from ds_engine.runtime import tensor_parallel as tensor_parallel
    from ds_engine.runtime import utils as utils
    from ds_engine.runtime import zenflow as zenflow

__all__ = ["lr_schedules"]

_LAZY = (
    "activation_checkpointing",
    "base_optimizer",
    "bf16_optimizer",
    "checkpoint_engine",
    "chunked_cross_entropy",
    "comm",
    "config",
    "config_utils",
    "constants",
    "data_pipeline",
    "dataloader",
    "domino",
    "engine",
    "fp16",
    "hybrid_engine",
    "model_checkpointing",
    "pipe",
    "precision_config",
    "rollout",
    "sequence_parallel",
    "swap_tensor",
    "tensor_parallel",
    "torch_autocast",
    "utils",
    "zenflow",
    "zero",
)


def __getattr__(name: str) -> ModuleType:
    if name in _LAZY:
        return importlib.import_module(f"ds_engine.runtime.{name}")
    raise AttributeError(f"module 'ds_engine.runtime' has no attribute {name!r}")
