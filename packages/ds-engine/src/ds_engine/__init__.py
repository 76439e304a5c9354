"""ds-engine: the config-driven training engine. `import ds_engine as deepspeed` runs DeepSpeed training scripts.

`initialize()` reads the ds_config once and builds the chain (cast model, base optimizer, fp16/bf16
or ZeRO wrapper, lr scheduler) around a `DeepSpeedEngine`; `ds-engine explain CONFIG` shows that
chain without building it. ZeRO stages >= 1 come from ds-zero (`pip install 'ds-engine[zero]'`),
pipeline parallelism from ds-pipe (`[pipe]`); both are imported only when asked for.
DeepSpeed's import paths work: `from ds_engine.pipe import PipelineModule`, `ds_engine.zero.Init`,
`import ds_engine.comm as dist`, `from ds_engine.ops.adam import DeepSpeedCPUAdam`,
`from ds_engine.runtime.lr_schedules import WarmupLR` (submodules loaded on first use).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ds_comm import get_accelerator, init_distributed
from ds_engine import accelerator, comm, git_version_info, lr_schedules
from ds_engine.__about__ import __version__
from ds_engine._engine.dataloader import DeepSpeedDataLoader
from ds_engine._engine.engine import DeepSpeedEngine
from ds_engine._hybrid.engine import DeepSpeedHybridEngine
from ds_engine._inference.init_inference import init_inference
from ds_engine._optim.torch_optimizers import Lamb, Lion
from ds_engine._optional import require
from ds_engine._parallel.tp_model_init import tp_model_init
from ds_engine._pipeline.build import PipelineError
from ds_engine._pipeline.engine import PipelineEngine
from ds_engine._setup.initialize import (
    DeepSpeedOptimizerCallable,
    DeepSpeedSchedulerCallable,
    add_config_arguments,
    initialize,
)
from ds_engine._step.precision import MixedPrecisionOptimizer
from ds_engine.config import DeepSpeedConfigError
from ds_engine.config._constants import TORCH_DISTRIBUTED_DEFAULT_PORT
from ds_engine.git_version_info import git_branch, git_hash
from ds_engine.runtime.base_optimizer import DeepSpeedOptimizer, ZeROOptimizer
from ds_engine.utils import OnDevice, log_dist, logger

if TYPE_CHECKING:  # type checkers see the lazy names' real types
    from ds_engine import checkpointing as checkpointing
    from ds_engine import inference as inference
    from ds_engine import linear as linear
    from ds_engine import module_inject as module_inject
    from ds_engine import moe as moe
    from ds_engine import ops as ops
    from ds_engine import pipe as pipe
    from ds_engine import runtime as runtime
    from ds_engine import sequence as sequence
    from ds_engine import utils as utils
    from ds_engine import zero as zero
    from ds_engine.config import DeepSpeedConfig
    from ds_engine.inference import DeepSpeedInferenceConfig as DeepSpeedInferenceConfig
    from ds_engine.inference import InferenceEngine as InferenceEngine
    from ds_parallel.tensor import set_autotp_mode as set_autotp_mode
    from ds_pipe import PipelineModule as PipelineModule

version = __version__
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in __version__.split("+")[0].split(".")[:3])
__git_hash__ = git_hash
__git_branch__ = git_branch

__all__ = [
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
    "DeepSpeedConfig",
    "DeepSpeedConfigError",
    "DeepSpeedDataLoader",
    "DeepSpeedEngine",
    "DeepSpeedHybridEngine",
    "DeepSpeedOptimizer",
    "DeepSpeedOptimizerCallable",
    "Lamb",
    "Lion",
    "MixedPrecisionOptimizer",
    "OnDevice",
    "PipelineEngine",
    "PipelineError",
    "DeepSpeedSchedulerCallable",
    "ZeROOptimizer",
    "__git_branch__",
    "__git_hash__",
    "__version__",
    "accelerator",
    "add_config_arguments",
    "comm",
    "get_accelerator",
    "git_branch",
    "git_hash",
    "git_version_info",
    "init_distributed",
    "init_inference",
    "initialize",
    "log_dist",
    "logger",
    "lr_schedules",
    "tp_model_init",
    "version",
]

#: DeepSpeed's submodule paths (`deepspeed.pipe`, `deepspeed.zero`, `deepspeed.ops.adam`...): real submodules,
#: imported on first use so that `import ds_engine` loads neither ds-zero nor ds-pipe.
_SUBMODULES = (
    "checkpoint",
    "checkpointing",
    "constants",
    "inference",
    "linear",
    "module_inject",
    "moe",
    "ops",
    "pipe",
    "runtime",
    "sequence",
    "utils",
    "zero",
)
#: `deepspeed.InferenceEngine` and friends: served from their submodules on first use (pydantic, ds-parallel).
_LAZY_NAMES = {
    "InferenceEngine": "ds_engine.inference",
    "DeepSpeedInferenceConfig": "ds_engine.inference",
    "set_autotp_mode": "ds_engine.module_inject",
}


def __getattr__(name: str) -> object:
    if name == "DeepSpeedConfig":  # pydantic models (~0.3 s to import): loaded on first use
        return importlib.import_module("ds_engine.config").DeepSpeedConfig
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"ds_engine.{name}")
    if name == "PipelineModule":  # `deepspeed.PipelineModule`
        return require("ds_pipe", extra="pipe", feature="deepspeed.PipelineModule").PipelineModule
    raise AttributeError(f"module 'ds_engine' has no attribute {name!r}")
