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

from ds_engine.__about__ import __version__
from ds_engine._report.logger_tree import adopt_ds_loggers

# ds's loggers report through DeepSpeed's "DeepSpeed" logger from the first import (`_report.logging`'s note).
adopt_ds_loggers()

if TYPE_CHECKING:  # type checkers see the lazy names' real types
    from ds_comm import get_accelerator as get_accelerator
    from ds_comm import init_distributed as init_distributed
    from ds_engine import accelerator as accelerator
    from ds_engine import checkpointing as checkpointing
    from ds_engine import comm as comm
    from ds_engine import git_version_info as git_version_info
    from ds_engine import inference as inference
    from ds_engine import linear as linear
    from ds_engine import lr_schedules as lr_schedules
    from ds_engine import module_inject as module_inject
    from ds_engine import moe as moe
    from ds_engine import ops as ops
    from ds_engine import pipe as pipe
    from ds_engine import runtime as runtime
    from ds_engine import sequence as sequence
    from ds_engine import utils as utils
    from ds_engine import zero as zero
    from ds_engine._engine.dataloader import DeepSpeedDataLoader as DeepSpeedDataLoader
    from ds_engine._engine.engine import DeepSpeedEngine as DeepSpeedEngine
    from ds_engine._hybrid.engine import DeepSpeedHybridEngine as DeepSpeedHybridEngine
    from ds_engine._inference.init_inference import init_inference as init_inference
    from ds_engine._optim.torch_optimizers import Lamb as Lamb
    from ds_engine._optim.torch_optimizers import Lion as Lion
    from ds_engine._parallel.tp_model_init import tp_model_init as tp_model_init
    from ds_engine._pipeline.build import PipelineError as PipelineError
    from ds_engine._pipeline.engine import PipelineEngine as PipelineEngine
    from ds_engine._setup.initialize import DeepSpeedOptimizerCallable as DeepSpeedOptimizerCallable
    from ds_engine._setup.initialize import DeepSpeedSchedulerCallable as DeepSpeedSchedulerCallable
    from ds_engine._setup.initialize import add_config_arguments as add_config_arguments
    from ds_engine._setup.initialize import initialize as initialize
    from ds_engine._step.precision import MixedPrecisionOptimizer as MixedPrecisionOptimizer
    from ds_engine.config import DeepSpeedConfig
    from ds_engine.config import DeepSpeedConfigError as DeepSpeedConfigError
    from ds_engine.config._constants import TORCH_DISTRIBUTED_DEFAULT_PORT as TORCH_DISTRIBUTED_DEFAULT_PORT
    from ds_engine.git_version_info import git_branch as git_branch
    from ds_engine.git_version_info import git_hash as git_hash
    from ds_engine.inference import DeepSpeedInferenceConfig as DeepSpeedInferenceConfig
    from ds_engine.inference import InferenceEngine as InferenceEngine
    from ds_engine.runtime.base_optimizer import DeepSpeedOptimizer as DeepSpeedOptimizer
    from ds_engine.runtime.base_optimizer import ZeROOptimizer as ZeROOptimizer
    from ds_engine.utils import OnDevice as OnDevice
    from ds_engine.utils import log_dist as log_dist
    from ds_engine.utils import logger as logger
    from ds_parallel.tensor import set_autotp_mode as set_autotp_mode
    from ds_pipe import PipelineModule as PipelineModule

version = __version__
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in __version__.split("+")[0].split(".")[:3])

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
#: Every other public name, served from the module that defines it on first use (then cached here): importing
#: the package costs almost nothing beyond torch, and a script pays for the engine, the config models
#: (pydantic) and the ops only when it touches them. Keys are names, values `(module, attribute)`.
_LAZY_NAMES: dict[str, tuple[str, str]] = {
    "get_accelerator": ("ds_comm", "get_accelerator"),
    "init_distributed": ("ds_comm", "init_distributed"),
    "DeepSpeedDataLoader": ("ds_engine._engine.dataloader", "DeepSpeedDataLoader"),
    "DeepSpeedEngine": ("ds_engine._engine.engine", "DeepSpeedEngine"),
    "DeepSpeedHybridEngine": ("ds_engine._hybrid.engine", "DeepSpeedHybridEngine"),
    "init_inference": ("ds_engine._inference.init_inference", "init_inference"),
    "Lamb": ("ds_engine._optim.torch_optimizers", "Lamb"),
    "Lion": ("ds_engine._optim.torch_optimizers", "Lion"),
    "tp_model_init": ("ds_engine._parallel.tp_model_init", "tp_model_init"),
    "PipelineError": ("ds_engine._pipeline.build", "PipelineError"),
    "PipelineEngine": ("ds_engine._pipeline.engine", "PipelineEngine"),
    "DeepSpeedOptimizerCallable": ("ds_engine._setup.initialize", "DeepSpeedOptimizerCallable"),
    "DeepSpeedSchedulerCallable": ("ds_engine._setup.initialize", "DeepSpeedSchedulerCallable"),
    "add_config_arguments": ("ds_engine._setup.initialize", "add_config_arguments"),
    "initialize": ("ds_engine._setup.initialize", "initialize"),
    "MixedPrecisionOptimizer": ("ds_engine._step.precision", "MixedPrecisionOptimizer"),
    # The config models import pydantic (~0.3 s to import).
    "DeepSpeedConfig": ("ds_engine.config", "DeepSpeedConfig"),
    "DeepSpeedConfigError": ("ds_engine.config", "DeepSpeedConfigError"),
    "TORCH_DISTRIBUTED_DEFAULT_PORT": ("ds_engine.config._constants", "TORCH_DISTRIBUTED_DEFAULT_PORT"),
    "git_branch": ("ds_engine.git_version_info", "git_branch"),
    "git_hash": ("ds_engine.git_version_info", "git_hash"),
    "__git_branch__": ("ds_engine.git_version_info", "git_branch"),
    "__git_hash__": ("ds_engine.git_version_info", "git_hash"),
    "DeepSpeedOptimizer": ("ds_engine.runtime.base_optimizer", "DeepSpeedOptimizer"),
    "ZeROOptimizer": ("ds_engine.runtime.base_optimizer", "ZeROOptimizer"),
    "OnDevice": ("ds_engine.utils", "OnDevice"),
    "log_dist": ("ds_engine.utils", "log_dist"),
    "logger": ("ds_engine.utils", "logger"),
    # `deepspeed.InferenceEngine` and friends (pydantic, ds-parallel).
    "InferenceEngine": ("ds_engine.inference", "InferenceEngine"),
    "DeepSpeedInferenceConfig": ("ds_engine.inference", "DeepSpeedInferenceConfig"),
    "set_autotp_mode": ("ds_engine.module_inject", "set_autotp_mode"),
}
#: Public submodules served the same way (`ds_engine.comm`, `ds_engine.lr_schedules`...).
_LAZY_SUBMODULES = frozenset({*_SUBMODULES, "accelerator", "comm", "git_version_info", "lr_schedules"})


def __getattr__(name: str) -> object:
    if name in _LAZY_NAMES:
        module, attribute = _LAZY_NAMES[name]
        value = getattr(importlib.import_module(module), attribute)
    elif name in _LAZY_SUBMODULES:
        value = importlib.import_module(f"ds_engine.{name}")
    elif name == "PipelineModule":  # `deepspeed.PipelineModule`
        from ds_engine._optional import require

        return require("ds_pipe", extra="pipe", feature="deepspeed.PipelineModule").PipelineModule
    else:
        raise AttributeError(f"module 'ds_engine' has no attribute {name!r}")
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES, *_LAZY_SUBMODULES})
