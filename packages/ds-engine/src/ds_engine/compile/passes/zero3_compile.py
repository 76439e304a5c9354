"""`deepspeed.compile.passes.zero3_compile`, DeepSpeed's module path: the ZeRO-3 pass.

It puts the gathers and releases in the graph. ds applies the pass itself when a schedule lists it (see
`ds_engine._plan.compile_schedule`); the callable below is the schedule entry DeepSpeed's scripts use (a
`BuiltinPass`), resolved to its name by identity.
"""

from ds_engine._plan.pass_contracts import BUILTIN_PASSES

NAME = "zero3_compile"
CONTRACT = BUILTIN_PASSES[NAME].contract
add_z3_gather_release = BUILTIN_PASSES[NAME]

__all__ = ["CONTRACT", "NAME", "add_z3_gather_release"]
