"""`deepspeed.runtime.utils`: the helpers of DeepSpeed's module that scripts and frameworks import.

`move_to_device` / `copy_to_device` (nested batches to a device; Accelerate's ALST test uses the first),
`see_memory_usage` / `empty_cache` (memory debugging), `clip_grad_norm_`, `get_global_norm`,
`has_inf_or_nan`, `is_model_parallel_parameter` (gradient norms, DeepSpeed's semantics), `set_random_seed`
and `ensure_directory_exists`. DeepSpeed's internal helpers of this module (flat-buffer alignment,
`PartitionedTensor`, the MoE norm variants...) are not part of ds's surface.
"""

from __future__ import annotations

import os
import random

import torch

from ds_engine._grad_norms import clip_grad_norm_, get_global_norm, has_inf_or_nan, is_model_parallel_parameter
from ds_engine._memory_report import empty_cache, see_memory_usage
from ds_engine._tensor_moves import copy_to_device, move_to_device

__all__ = [
    "clip_grad_norm_",
    "copy_to_device",
    "empty_cache",
    "ensure_directory_exists",
    "get_global_norm",
    "has_inf_or_nan",
    "is_model_parallel_parameter",
    "move_to_device",
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
