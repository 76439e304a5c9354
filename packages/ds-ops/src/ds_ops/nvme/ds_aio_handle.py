"""`deepspeed.nvme.ds_aio_handle`: `ds_io --engine aio_handle`'s engine, DeepSpeed's `AIOHandle_Engine`.

One task's aio handle (`args`' block size, queue depth, submission settings and `io_parallel` threads), its
page-locked buffer of `io_size` random bytes and its file(s): one file for every loop, or a new one each loop
with `--different_file_each_iteration`. A read needs the file to exist at its size (made from random bytes
first, untimed); a write starts from no file. Each `read`/`write` is one request on the handle, waited for,
timed into `ctxt[ELAPSED_SEC]` (a list, one entry per loop). With `--gpu` the buffer is in the task's device
memory and the request goes through a pinned bounce buffer (GPUDirect Storage, `--use_gds`, is refused: ds
has no cuFile path). `args` is `ds_aio_args.get_validated_args()`'s namespace.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ds_ops.aio import aio_handle
from ds_ops.nvme.ds_aio_constants import (
    BOUNCE_BUFFER,
    BUFFER,
    ELAPSED_SEC,
    FILE,
    HANDLE,
    NUM_BYTES,
    USE_CPU_LOCKED_TENSOR,
    USE_GDS,
)
from ds_ops.nvme.test_ds_aio_utils import create_file, create_filename, create_page_locked_tensor, task_log

__all__ = ["AIOHandle_Engine"]


class AIOHandle_Engine:  # noqa: N801 - DeepSpeed's name
    """One task's handle, buffer and files, read or written one request per loop (module docstring)."""

    def __init__(self, args: Any, tid: int, read_op: bool) -> None:
        self.ctxt = self._create_context(args, tid, read_op)

    def fini(self) -> None:
        """Give the locked buffers back and close the handle."""
        handle = self.ctxt[HANDLE]
        for key in (BUFFER, BOUNCE_BUFFER):
            buffer = self.ctxt[key]
            if buffer is not None and buffer.device.type == "cpu" and self.ctxt[USE_CPU_LOCKED_TENSOR]:
                handle.free_cpu_locked_tensor(buffer)
            self.ctxt[key] = None
        handle.close()

    def read(self, args: Any, tid: int, loop_id: int) -> float:
        """Read loop `loop_id`'s file into the buffer (through the bounce buffer for device memory); seconds."""
        start = time.perf_counter()
        bounce = self.ctxt[BOUNCE_BUFFER]
        target = bounce if bounce is not None else self.ctxt[BUFFER]
        self.ctxt[HANDLE].pread(target, self.ctxt[FILE][loop_id], args.validate, True)
        self.ctxt[HANDLE].wait()
        if bounce is not None:
            self.ctxt[BUFFER].copy_(bounce)
        return self._timed(start)

    def write(self, args: Any, tid: int, loop_id: int) -> float:
        """Write the buffer (through the bounce buffer for device memory) to loop `loop_id`'s file; seconds."""
        start = time.perf_counter()
        bounce = self.ctxt[BOUNCE_BUFFER]
        if bounce is not None:
            bounce.copy_(self.ctxt[BUFFER])
        source = bounce if bounce is not None else self.ctxt[BUFFER]
        self.ctxt[HANDLE].pwrite(source, self.ctxt[FILE][loop_id], args.validate, True)
        self.ctxt[HANDLE].wait()
        return self._timed(start)

    def _timed(self, start: float) -> float:
        elapsed = time.perf_counter() - start
        self.ctxt[ELAPSED_SEC].append(elapsed)
        return elapsed

    def _create_files(self, args: Any, folder: str, tid: int) -> list[str]:
        loops = range(args.total_loops)
        if args.different_file_each_iteration:
            names = [create_filename(folder, args.read, args.io_size, f"{tid}_{i}") for i in loops]
        else:
            names = [create_filename(folder, args.read, args.io_size, f"{tid}_0") for _ in loops]
        for name in dict.fromkeys(names):
            if args.read:
                if not (os.path.isfile(name) and os.path.getsize(name) == args.io_size):
                    create_file(name, args.io_size)
            elif os.path.isfile(name):
                os.remove(name)
        return names

    def _create_context(self, args: Any, tid: int, read_op: bool) -> dict[str, Any]:
        if args.use_gds:
            raise ValueError("--use_gds: ds has no GPUDirect Storage (cuFile) path; drop --use_gds")
        device_id, folder = args.mapping_list[tid]
        files = self._create_files(args, folder, tid)
        handle = aio_handle(
            args.block_size, args.queue_depth, args.single_submit, not args.sequential_requests, args.io_parallel or 1
        )
        task_log(tid, "Created DeepNVMe handle engine")
        bounce = None
        if args.gpu:
            buffer = torch.randint(high=128, size=(args.io_size,), dtype=torch.uint8, device=f"cuda:{device_id}")
            if not args.slow_bounce_buffer:
                bounce = create_page_locked_tensor(args.io_size, args.use_accelerator_pin_memory, handle)
        else:
            buffer = create_page_locked_tensor(args.io_size, args.use_accelerator_pin_memory, handle)
        kind = "Read" if read_op else "Write"
        task_log(tid, f"{kind} file {files} of size {args.io_size} bytes from buffer on device {buffer.device}", True)
        return {
            FILE: files,
            NUM_BYTES: args.io_size,
            HANDLE: handle,
            USE_GDS: False,
            BUFFER: buffer,
            BOUNCE_BUFFER: bounce,
            ELAPSED_SEC: [],
            USE_CPU_LOCKED_TENSOR: not args.use_accelerator_pin_memory,
        }
