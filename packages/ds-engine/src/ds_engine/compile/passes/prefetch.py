"""`deepspeed.compile.passes.prefetch`, DeepSpeed's module path: the prefetch pass.

It starts ZeRO-3 gathers ahead of their use. ds applies the pass itself when a schedule lists it (see
`ds_engine._plan.compile_schedule`); the callable below is the schedule entry DeepSpeed's scripts use (a
`BuiltinPass`), resolved to its name by identity.
"""

from ds_engine._plan.pass_contracts import BUILTIN_PASSES

NAME = "prefetch"
CONTRACT = BUILTIN_PASSES[NAME].contract
schedule_prefetch = BUILTIN_PASSES[NAME]

__all__ = ["CONTRACT", "NAME", "schedule_prefetch"]
