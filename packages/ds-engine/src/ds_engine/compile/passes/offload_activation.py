"""`deepspeed.compile.passes.offload_activation`, DeepSpeed's module path: activation offload.

The callable below is the schedule entry DeepSpeed's scripts use (a `BuiltinPass`, resolved to its name by
identity, with DeepSpeed's contract); `engine.compile()` refuses a schedule that lists it, naming
`activation_checkpointing.cpu_checkpointing`, the ds config key that does the job.
"""

from ds_engine._plan.pass_contracts import BUILTIN_PASSES

NAME = "offload_activation"
FLOOR_NAME = "offload_activation_floor"
CONTRACT = BUILTIN_PASSES[NAME].contract
offload_activation = BUILTIN_PASSES[NAME]
offload_activation_floor = BUILTIN_PASSES[FLOOR_NAME]

__all__ = ["CONTRACT", "FLOOR_NAME", "NAME", "offload_activation", "offload_activation_floor"]
