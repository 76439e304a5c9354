"""`PinMemoryBuilder`: DeepSpeed's pin_memory op (page-locked host buffers), with nothing to compile.

DeepSpeed builds this op as a torch C++ extension around posix_memalign, mlock, munlock and free.
ds-comm makes those calls through ctypes (see `ds_comm.LockedHostAllocator`), so this builder only
checks the host and hands out that allocator: `PinMemoryBuilder().load().pin_handle()` works on any
POSIX host without a compiler, and the first use costs no build.

Nothing here imports torch at import time (the wheel's build hook imports this package).
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import TYPE_CHECKING

from ds_ops.op_builder._base import OpBuilder, OpNotCompatibleError

if TYPE_CHECKING:
    from ds_comm import LockedHostAllocator

__all__ = ["PinMemoryBuilder", "PinMemoryOp"]


class PinMemoryOp:
    """The loaded op: `pin_handle()` gives the process-wide allocator of locked host buffers."""

    def pin_handle(self) -> LockedHostAllocator:
        """The allocator (`new_cpu_locked_tensor`, `free_cpu_locked_tensor(_by_ptr)`, `is_pinned`)."""
        from ds_comm import locked_host_allocator  # noqa: PLC0415 - ds_comm imports torch

        return locked_host_allocator()


class PinMemoryBuilder(OpBuilder):
    """Page-locked host memory (DeepSpeed's `pin_memory` op); compatible on POSIX hosts."""

    NAME = "pin_memory"

    def absolute_name(self) -> str:
        return "ds_ops.pin_memory_op"

    def runtime_problems(self) -> list[str]:
        if os.name != "posix":
            return [f"page-locked host memory needs POSIX mlock (this is {platform.system()})"]
        return []

    def build_problems(self) -> list[str]:
        return []  # ctypes calls into libc: there is nothing to compile

    def prebuilt_installed(self) -> bool:
        return False

    def prebuilt_library(self) -> tuple[Path | None, str]:
        return None, "the pin_memory op calls libc through ctypes; nothing is built"

    def load(self, verbose: bool = True) -> PinMemoryOp:  # type: ignore[override]
        """The op (not a library: see the module docstring).

        Raises:
            OpNotCompatibleError: the host is not POSIX.
        """
        problems = self.runtime_problems()
        if problems:
            raise OpNotCompatibleError(f"op {self.name} cannot run on this machine: {'; '.join(problems)}")
        self.loaded_from = "libc"
        return PinMemoryOp()
