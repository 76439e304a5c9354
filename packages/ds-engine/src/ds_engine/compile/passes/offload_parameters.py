"""`deepspeed.compile.passes.offload_parameters`, DeepSpeed's module path: parameter offload.

The callable below is the schedule entry DeepSpeed's scripts use (a `BuiltinPass`, resolved to its name by
identity, with DeepSpeed's contract); `engine.compile()` refuses a schedule that lists it, naming
`zero_optimization.offload_param`, the ds config key that does the job.
"""

from ds_engine._plan.pass_contracts import BUILTIN_PASSES

NAME = "offload_parameters"
CONTRACT = BUILTIN_PASSES[NAME].contract
offload_parameter_fwd = BUILTIN_PASSES[NAME]

__all__ = ["CONTRACT", "NAME", "offload_parameter_fwd"]
