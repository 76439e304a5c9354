"""`deepspeed.nvme.ds_aio_basic`: `ds_io --engine aio_basic`'s engine, DeepSpeed's `AIOBasic_Engine`.

Each read or write is one functional aio call (`ds_ops.aio.aio_read` / `aio_write`: a handle per call) on the
task's file with `args`' block size, queue depth and submission settings, timed into `ctxt[ELAPSED_SEC]`; a
write removes the file first (untimed), so no write overwrites one in place. `args` is ds_io's namespace
(`mapping_list[tid]` is `(device_id, folder)`, `io_size`, `read`, `block_size`, `queue_depth`, `single_submit`,
`sequential_requests`, `validate`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ds_ops.aio import aio_handle, aio_read, aio_write
from ds_ops.nvme.ds_aio_constants import BUFFER, ELAPSED_SEC, FILE, NUM_BYTES
from ds_ops.nvme_torch_io import create_filename

__all__ = ["AIOBasic_Engine"]


class AIOBasic_Engine:  # noqa: N801 - DeepSpeed's name
    """One task's file and pinned buffer, read or written by the functional aio calls (module docstring)."""

    def __init__(self, args: Any, tid: int, read_op: bool) -> None:
        _device_id, folder = args.mapping_list[tid]
        path = create_filename(folder, bool(args.read), args.io_size, tid)
        if args.read and not (os.path.isfile(path) and os.path.getsize(path) == args.io_size):
            with open(path, "wb") as f:  # DeepSpeed fills it from /dev/urandom with dd
                f.write(os.urandom(args.io_size))
        self._pinner = aio_handle()
        buffer = self._pinner.new_cpu_locked_tensor(args.io_size, torch.empty(0, dtype=torch.uint8))
        self.ctxt: dict[str, Any] = {FILE: path, NUM_BYTES: args.io_size, BUFFER: buffer, ELAPSED_SEC: 0.0}

    def fini(self) -> None:
        """Give the pinned buffer back."""
        buffer = self.ctxt.pop(BUFFER, None)
        if buffer is not None:
            self._pinner.free_cpu_locked_tensor(buffer)
        self.ctxt[BUFFER] = None
        self._pinner.close()

    def _timed(self, call: Any, args: Any) -> float:
        start = time.perf_counter()
        call(
            self.ctxt[BUFFER],
            self.ctxt[FILE],
            args.block_size,
            args.queue_depth,
            args.single_submit,
            not args.sequential_requests,
            args.validate,
        )
        elapsed = time.perf_counter() - start
        self.ctxt[ELAPSED_SEC] += elapsed
        return elapsed

    def read(self, args: Any, tid: int | None = None, loop_id: int | None = None) -> float:
        """One timed read of the task's file into the buffer; returns its seconds."""
        return self._timed(aio_read, args)

    def write(self, args: Any, tid: int | None = None, loop_id: int | None = None) -> float:
        """One timed write of the buffer (the old file removed first, untimed); returns its seconds."""
        if os.path.isfile(self.ctxt[FILE]):
            os.remove(self.ctxt[FILE])
        return self._timed(aio_write, args)
