"""`deepspeed.constants`: DeepSpeed's named constants that scripts import."""

from __future__ import annotations

__all__ = [
    "CROSS_RANK",
    "CROSS_SIZE",
    "INFERENCE_GENERIC_MODE",
    "INFERENCE_SPECIALIZED_MODE",
    "LOCAL_RANK",
    "TORCH_DISTRIBUTED_DEFAULT_PORT",
]

#: The rendezvous port `init_distributed()` / `initialize()` use when none is given.
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500

INFERENCE_GENERIC_MODE = "generic"
INFERENCE_SPECIALIZED_MODE = "specialized"

#: Environment variable names of the launcher's layout.
CROSS_RANK = "CROSS_RANK"
CROSS_SIZE = "CROSS_SIZE"
LOCAL_RANK = "LOCAL_RANK"
