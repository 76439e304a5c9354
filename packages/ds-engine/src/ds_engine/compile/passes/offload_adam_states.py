"""`deepspeed.compile.passes.offload_adam_states`, DeepSpeed's module path: optimizer-state offload.

The callable below is the schedule entry DeepSpeed's scripts use (a `BuiltinPass`, resolved to its name by
identity, with DeepSpeed's contract); `engine.compile()` refuses a schedule that lists it, naming
`zero_optimization.offload_optimizer`, the ds config key that does the job.
"""

from ds_engine._plan.pass_contracts import BUILTIN_PASSES

NAME = "offload_adam_states"
NAME_SYNC = "offload_adam_states_sync"
NAME_FOR_INIT = "offload_adam_states_for_init"
CONTRACT = BUILTIN_PASSES[NAME].contract
CONTRACT_SYNC = BUILTIN_PASSES[NAME_SYNC].contract
CONTRACT_FOR_INIT = BUILTIN_PASSES[NAME_FOR_INIT].contract
move_opt_states = BUILTIN_PASSES[NAME]
move_opt_states_sync = BUILTIN_PASSES[NAME_SYNC]
offload_adam_states_for_init = BUILTIN_PASSES[NAME_FOR_INIT]

__all__ = [
    "CONTRACT",
    "CONTRACT_FOR_INIT",
    "CONTRACT_SYNC",
    "NAME",
    "NAME_FOR_INIT",
    "NAME_SYNC",
    "move_opt_states",
    "move_opt_states_sync",
    "offload_adam_states_for_init",
]
