"""`deepspeed.compile.passes.selective_gather`, DeepSpeed's module path: selective unsharding.

The partitioned parameters that fit are kept whole. ds applies the pass itself when a schedule lists it (see
`ds_engine._plan.compile_schedule`); the callable below is the schedule entry DeepSpeed's scripts use (a
`BuiltinPass`), resolved to its name by identity.
"""

from ds_engine._plan.pass_contracts import BUILTIN_PASSES

NAME = "selective_gather"
CONTRACT = BUILTIN_PASSES[NAME].contract
selective_gather = BUILTIN_PASSES[NAME]

__all__ = ["CONTRACT", "NAME", "selective_gather"]
