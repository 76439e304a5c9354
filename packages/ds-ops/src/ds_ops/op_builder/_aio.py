"""`AsyncIOBuilder`: the async_io op (ZeRO-Infinity's file I/O) and what this host gives it.

[Note: kernel interfaces] DeepSpeed's async_io links libaio, so it is incompatible wherever
libaio-dev is missing. Ours calls the kernel directly: io_uring through its raw syscalls (the
header <linux/io_uring.h> comes with the kernel headers, linux-libc-dev on Debian), so neither
liburing nor libaio is needed. Where io_uring is missing or forbidden (kernel < 5.6,
`kernel.io_uring_disabled`, a container's seccomp filter) the op falls back to a pread/pwrite
thread pool, which works on any POSIX kernel. `is_compatible()` says which one this host gets and
which optional libraries are absent; neither absence makes the op incompatible.

Nothing here imports torch (the wheel's build hook uses this module).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ds_ops.op_builder._base import CFunctionSpec, OpBuilder
from ds_ops.op_builder._toolchain import probe_compiler

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_i32p = ctypes.POINTER(_i32)

IO_URING_SETUP_SYSCALL = 425  # the same number on every Linux architecture
IO_URING_PARAMS_BYTES = 120  # sizeof(struct io_uring_params)

_HEADER_PROBE = """#include <fcntl.h>
#include <linux/io_uring.h>
#include <sys/syscall.h>
#include <thread>
extern "C" int ds_probe(void) { return IORING_OP_READ + IORING_OP_WRITE + O_DIRECT; }
"""


@functools.lru_cache(maxsize=1)
def io_uring_status() -> tuple[bool, str]:
    """(True, "") when this process may set up an io_uring ring, else (False, why not).

    Asks the kernel directly (io_uring_setup with 2 entries, then close), so a seccomp filter or
    `kernel.io_uring_disabled` shows exactly as the op will meet it.
    """
    if platform.system() != "Linux":
        return False, f"io_uring is Linux-only (this is {platform.system()})"
    libc = ctypes.CDLL(None, use_errno=True)
    params = ctypes.create_string_buffer(IO_URING_PARAMS_BYTES)
    fd = libc.syscall(ctypes.c_long(IO_URING_SETUP_SYSCALL), ctypes.c_uint(2), params)
    if fd >= 0:
        os.close(fd)
        return True, ""
    code = ctypes.get_errno()
    why = f"io_uring_setup failed with {errno.errorcode.get(code, code)} ({os.strerror(code)})"
    disabled = _read_text("/proc/sys/kernel/io_uring_disabled")
    if code == errno.ENOSYS:
        why += f"; kernel {platform.release()} has no io_uring (needs 5.6+)"
    elif code == errno.EPERM and disabled not in (None, "0"):
        why += f"; kernel.io_uring_disabled = {disabled}"
    elif code == errno.EPERM:
        why += "; probably a seccomp filter (containers often block io_uring)"
    return False, why


def _read_text(path: str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def _library_present(name: str, header: str) -> bool:
    return ctypes.util.find_library(name) is not None or Path("/usr/include", header).exists()


class AsyncIOBuilder(OpBuilder):
    """Asynchronous reads and writes between host memory and files (DeepSpeed's async_io op)."""

    NAME = "async_io"
    SOURCES = ("aio/ds_aio.cpp",)
    INCLUDE_DIRS = ("includes", "aio")
    FUNCTIONS: ClassVar[dict[str, CFunctionSpec]] = {
        # block_size, queue_depth, single_submit, overlap_events, num_threads, engine, *engine_used, *setup_error
        "ds_aio_create": (_ptr, (_i64, _i32, _i32, _i32, _i32, _i32, _i32p, _i32p)),
        "ds_aio_destroy": (None, (_ptr,)),
        # handle, is_write, buffer, nbytes, path, file_offset, direct_mode, result
        "ds_aio_submit": (None, (_ptr, _i32, _ptr, _i64, ctypes.c_char_p, _i64, _i32, _ptr, _i32)),
        "ds_aio_wait": (_i64, (_ptr,)),
        "ds_aio_probe_io_uring": (_i32, ()),
    }
    handle_class: ClassVar[Callable[..., Any] | None] = None
    """`ds_ops.aio.AsyncIOHandle`, set when `ds_ops.aio` is imported (importing `ds_ops` does it): `load()`
    hangs it on the library as `aio_handle`, so DeepSpeed's `AsyncIOBuilder().load().aio_handle(...)` works."""
    functional: ClassVar[dict[str, Callable[..., int]]] = {}
    """DeepSpeed's functional calls (`aio_read`, `aio_write`), set with `handle_class` and hung on the library too."""

    def load(self, verbose: bool = True) -> ctypes.CDLL:
        """The op's library (see `OpBuilder.load`), with DeepSpeed's `aio_handle` constructor and functional
        `aio_read` / `aio_write` on it."""
        library = super().load(verbose=verbose)
        if self.handle_class is not None:
            library.aio_handle = self.handle_class
        for name, function in self.functional.items():
            setattr(library, name, function)
        return library

    def absolute_name(self) -> str:
        return "ds_ops.aio.async_io_op"

    def simd_level(self) -> str:
        """No SIMD code: a prebuilt library runs on any CPU of its architecture."""
        return "none"

    def cxx_args(self) -> list[str]:
        return [
            "-O3",
            "-std=c++17",
            "-fPIC",
            "-pthread",
            "-fvisibility=hidden",
            '-DDS_SIMD_LEVEL="none"',
            *(f"-I{path}" for path in self.include_paths()),
        ]

    def extra_ldflags(self) -> list[str]:
        return ["-shared", "-pthread"]

    def build_problems(self) -> list[str]:
        problems = super().build_problems()
        if platform.system() != "Linux":
            problems.append(f"the async_io op needs Linux (O_DIRECT, io_uring); this is {platform.system()}")
        return problems

    def flag_problems(self, compiler: str) -> list[str]:
        """Compile a probe that includes the kernel's io_uring header with this op's flags."""
        flags = tuple(flag for flag in self.cxx_args() if not flag.startswith(("-I", "-D")))
        ok, message = probe_compiler(compiler, flags, tuple(self.extra_ldflags()), _HEADER_PROBE)
        if ok:
            return []
        hint = " (install the kernel headers: Debian/Ubuntu linux-libc-dev)" if "io_uring.h" in message else ""
        return [f"the compiler cannot build against <linux/io_uring.h> with this op's flags{hint}: {message}"]

    def compatibility_notes(self) -> list[str]:
        """Which engine the op gets here, and the optional libraries it does without."""
        available, why_not = io_uring_status()
        if available:
            engine = f"engine io_uring through raw syscalls (kernel {platform.release()})"
        else:
            engine = f"engine psync (pread/pwrite thread pool; slower): {why_not}"
        missing = []
        if not _library_present("uring", "liburing.h"):
            missing.append("liburing not installed (Debian: liburing-dev)")
        if not _library_present("aio", "libaio.h"):
            missing.append("libaio not installed (Debian: libaio-dev)")
        notes = [engine]
        if missing:
            notes.append(f"{'; '.join(missing)}; not needed: the op calls the kernel directly")
        return notes
