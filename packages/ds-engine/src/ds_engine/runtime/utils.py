"""`deepspeed.runtime.utils`: the helpers of DeepSpeed's module that scripts and frameworks import.

`move_to_device` / `copy_to_device` (nested batches to a device; Accelerate's ALST test uses the first),
`see_memory_usage` / `empty_cache` (memory debugging), `clip_grad_norm_`, `get_global_norm`,
`has_inf_or_nan`, `is_model_parallel_parameter` (gradient norms, DeepSpeed's semantics),
`count_used_parameters_in_backward` (from a backward hook: how many parameters this backward reaches),
`CheckOverflow` / `get_weight_norm` / `is_moe_param` (an inf/nan check agreed across the ranks of a step),
`set_random_seed`, `ensure_directory_exists` and `call_to_str` (a call's text, as schedules and timers name
their steps).
`partition_uniform` / `partition_balanced` / `prefix_sum_inc` (how a pipeline's layers split into stages) and
`PartitionedTensor` (a rank's slice of a tensor across a group) are ds-pipe's, imported on first use (the
`pipe` extra). DeepSpeed's internal helpers of this module (flat-buffer
alignment, the MoE norm variants...) are not part of ds's surface.
"""

from __future__ import annotations

import os
import random
from typing import TYPE_CHECKING, Any

import torch

from ds_engine._report.memory import empty_cache, see_memory_usage
from ds_engine._step.backward_graph import count_used_parameters_in_backward
from ds_engine._step.grad_norms import clip_grad_norm_, get_global_norm, has_inf_or_nan, is_model_parallel_parameter
from ds_engine._step.overflow_check import CheckOverflow, get_weight_norm, is_moe_param
from ds_engine._step.tensor_moves import copy_to_device, move_to_device

if TYPE_CHECKING:  # served by __getattr__ from ds-pipe; type checkers see its own
    from ds_pipe import PartitionedTensor, partition_balanced, partition_uniform, prefix_sum_inc

__all__ = [
    "CheckOverflow",
    "PartitionedTensor",
    "call_to_str",
    "clip_grad_norm_",
    "copy_to_device",
    "count_used_parameters_in_backward",
    "empty_cache",
    "ensure_directory_exists",
    "get_global_norm",
    "get_weight_norm",
    "has_inf_or_nan",
    "is_model_parallel_parameter",
    "is_moe_param",
    "move_to_device",
    "partition_balanced",
    "partition_uniform",
    "prefix_sum_inc",
    "see_memory_usage",
    "set_random_seed",
]


def set_random_seed(seed: int) -> None:
    """Seed Python's `random`, numpy's global generator (when numpy is installed) and torch."""
    random.seed(seed)
    try:
        import numpy
    except ImportError:
        pass
    else:
        numpy.random.seed(seed % 2**32)  # numpy takes 32-bit seeds
    torch.manual_seed(seed % 2**63)


def ensure_directory_exists(filename: str) -> None:
    """Create the directory that will hold `filename`, if missing."""
    os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)


def call_to_str(base: str, *args: Any, **kwargs: Any) -> str:
    """`base(*args, **kwargs)` as text: positional arguments by `repr`, then `key=repr(value)` in the given order."""
    parts = [repr(arg) for arg in args] + [f"{key}={value!r}" for key, value in kwargs.items()]
    return f"{base}({', '.join(parts)})"


#: ds-pipe's partitioning helpers, served on first use (ds-pipe is an optional sibling).
_PIPE_NAMES = frozenset({"PartitionedTensor", "partition_balanced", "partition_uniform", "prefix_sum_inc"})


def __getattr__(name: str) -> Any:
    if name in _PIPE_NAMES:
        from ds_engine._optional import require

        return getattr(require("ds_pipe", extra="pipe", feature=f"deepspeed.runtime.utils.{name}"), name)
    raise AttributeError(f"module 'ds_engine.runtime.utils' has no attribute {name!r}")
