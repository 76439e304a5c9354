"""`deepspeed.compile.passes.zero_1_and_2_compile`, DeepSpeed's module path: the ZeRO-1/2 passes.

They compile the step; reduction stays eager in ds. ds applies the pass itself when a schedule lists it (see
`ds_engine._plan.compile_schedule`); the callable below is the schedule entry DeepSpeed's scripts use (a
`BuiltinPass`), resolved to its name by identity.
"""

from ds_engine._plan.pass_contracts import BUILTIN_PASSES

NAME_Z1 = "zero1_compile"
NAME_Z2 = "zero2_compile"
CONTRACT_Z1 = BUILTIN_PASSES[NAME_Z1].contract
CONTRACT_Z2 = BUILTIN_PASSES[NAME_Z2].contract
add_z1_reduce = BUILTIN_PASSES[NAME_Z1]
add_z2_reduce = BUILTIN_PASSES[NAME_Z2]

__all__ = ["CONTRACT_Z1", "CONTRACT_Z2", "NAME_Z1", "NAME_Z2", "add_z1_reduce", "add_z2_reduce"]
