"""ds-engine: the config-driven training engine. `import ds_engine as deepspeed` runs DeepSpeed training scripts.

`initialize()` reads the ds_config once and builds the chain (cast model, base optimizer, fp16/bf16
or ZeRO wrapper, lr scheduler) around a `DeepSpeedEngine`; `ds-engine explain CONFIG` shows that
chain without building it. ZeRO stages >= 1 come from ds-zero (`pip install 'ds-engine[zero]'`),
pipeline parallelism from ds-pipe (`[pipe]`); both are imported only when asked for
(`ds_engine.zero`, `ds_engine.pipe` resolve to them lazily).
"""

from __future__ import annotations

from ds_comm import init_distributed
from ds_engine import accelerator, comm, lr_schedules
from ds_engine.__about__ import __version__
from ds_engine._engine import DeepSpeedEngine
from ds_engine._initialize import add_config_arguments, initialize
from ds_engine._optional import require
from ds_engine._pipeline import PipelineError
from ds_engine._pipeline_engine import PipelineEngine
from ds_engine._precision import MixedPrecisionOptimizer
from ds_engine._torch_optimizers import Lamb, Lion
from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError

version = __version__

__all__ = [
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedEngine",
    "Lamb",
    "Lion",
    "MixedPrecisionOptimizer",
    "PipelineEngine",
    "PipelineError",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "comm",
    "init_distributed",
    "initialize",
    "lr_schedules",
    "version",
]

_LAZY = {"zero": ("ds_zero", "zero", "deepspeed.zero (ZeRO)"), "pipe": ("ds_pipe", "pipe", "deepspeed.pipe")}
_LAZY_ATTRS = {"PipelineModule": ("ds_pipe", "pipe", "deepspeed.PipelineModule"),
               "checkpointing": ("ds_pipe", "pipe", "deepspeed.checkpointing")}


def __getattr__(name: str) -> object:
    # `deepspeed.zero.Init(...)`, `deepspeed.pipe.PipelineModule`: the optional siblings, imported on first use.
    if name in _LAZY:
        module, extra, feature = _LAZY[name]
        return require(module, extra=extra, feature=feature)
    if name in _LAZY_ATTRS:
        module, extra, feature = _LAZY_ATTRS[name]
        return getattr(require(module, extra=extra, feature=feature), name)
    raise AttributeError(f"module 'ds_engine' has no attribute {name!r}")
