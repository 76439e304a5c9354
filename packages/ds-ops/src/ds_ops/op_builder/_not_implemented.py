"""`NotImplementedBuilder`: the builder an op name resolves to when ds does not implement that op.

DeepSpeed's CPU accelerator answers every op it lacks with one such builder, named
`deepspeed_not_implemented`, which `__compatible_ops__` lists as False: code that checks an op's
compatibility before using it (DeepSpeed's own tests skip that way) sees "not here" instead of an
import error. ds-engine's `deepspeed.ops.op_builder` maps DeepSpeed's builder names for ops ds does
not have to this class.
"""

from __future__ import annotations

from ds_ops.op_builder._base import OpBuilder


class NotImplementedBuilder(OpBuilder):
    """An op ds does not implement: never compatible; `load()` raises `OpNotCompatibleError`."""

    NAME = "deepspeed_not_implemented"

    def runtime_problems(self) -> list[str]:
        return ["this op is not implemented in ds"]

    def build_problems(self) -> list[str]:
        return ["this op is not implemented in ds: there is nothing to build"]

    def prebuilt_installed(self) -> bool:
        return False
