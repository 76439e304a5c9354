"""`ds_io --engine torch_io | torch_fastio`: time `torch.save` of the buffer, plain or through the FastPersist writer.

DeepSpeed's `ds_io` has engines beside the aio handle: `torch_io` (`TorchIO_Engine`) times
`torch.save(buffer, path)`; `torch_fastio` (`Torch_FastIO_Engine`) times `torch.save` into a `FastFileWriter`
over an aio handle and a `--fast_io_size` pinned buffer, closed (flushed) inside the timed part. Both time
writes only (DeepSpeed refuses reads for them). Each write removes the previous file first, so no write
overwrites one in place. The file holds torch's serialization of the buffer, a little larger than `io_size`.

The engine classes take DeepSpeed's arguments: `args` (ds_io's namespace: `mapping_list[tid]` is
`(device_id, folder)`, `io_size`, `gpu`, `torch_legacy_save`; for torch_fastio also `block_size`,
`queue_depth`, `single_submit`, `sequential_requests`, `io_parallel`, `fast_io_size`), the task id and
whether it reads; their `ctxt` dict holds the file, buffer and elapsed seconds under DeepSpeed's keys.
"""

from __future__ import annotations

import os
import time
import types
from typing import Any

import torch

from ds_ops.aio import AsyncIOHandle
from ds_ops.fast_io import FastFileWriter, FastFileWriterConfig

__all__ = ["TORCH_ENGINES", "TorchFastIOEngine", "TorchIOEngine", "run_torch_engine"]

TORCH_ENGINES = ("torch_io", "torch_fastio")

# DeepSpeed's context keys (`deepspeed.nvme.ds_aio_constants`).
BUFFER, NUM_BYTES, FILE, HANDLE, ELAPSED_SEC = "buffer", "num_bytes", "file", "handle", "elapsed_sec"
FAST_IO_BUFFER, USE_CPU_LOCKED_TENSOR = "fast_io_buffer", "cpu_locked_tensor"


def create_filename(folder: str, read_op: bool, size: int, tid: int | str) -> str:
    """DeepSpeed's name of task `tid`'s file."""
    return os.path.join(folder, f"_aio_{'read' if read_op else 'write'}_{size}.pt.{tid}")


class TorchIOEngine:
    """`torch.save` of an `io_size`-byte buffer to the task's file (DeepSpeed's `TorchIO_Engine`)."""

    name = "torch_io"

    def __init__(self, args: Any, tid: int, read_op: bool) -> None:
        if read_op:
            raise ValueError(f"--engine {self.name} times writes only (as DeepSpeed's); drop --read")
        self.zipfile_serialization = not getattr(args, "torch_legacy_save", False)
        device_id, folder = args.mapping_list[tid]
        self.ctxt: dict[str, Any] = {
            FILE: create_filename(folder, False, args.io_size, tid),
            NUM_BYTES: args.io_size,
            ELAPSED_SEC: 0.0,
        }
        self._setup(args, device_id)

    def _setup(self, args: Any, device_id: int) -> None:
        if getattr(args, "gpu", False):
            self.ctxt[BUFFER] = torch.randint(
                high=128, size=(args.io_size,), dtype=torch.uint8, device=f"cuda:{device_id}"
            )
        else:
            self.ctxt[BUFFER] = torch.randint(high=128, size=(args.io_size,), dtype=torch.uint8)

    def _save(self, path: str) -> None:
        torch.save(self.ctxt[BUFFER], path, _use_new_zipfile_serialization=self.zipfile_serialization)

    def write(self, args: Any = None, tid: int | None = None, loop_id: int | None = None) -> float:
        """One timed write of the buffer (the old file removed first, untimed); returns its seconds."""
        path = self.ctxt[FILE]
        if os.path.isfile(path):
            os.remove(path)
        start = time.perf_counter()
        self._save(path)
        elapsed = time.perf_counter() - start
        self.ctxt[ELAPSED_SEC] += elapsed
        return elapsed

    def read(self, args: Any = None, tid: int | None = None, loop_id: int | None = None) -> float:
        raise ValueError(f"--engine {self.name} times writes only (as DeepSpeed's)")

    def fini(self) -> None:
        """Release the buffers (the file stays, as in DeepSpeed)."""
        self.ctxt[BUFFER] = None


class TorchFastIOEngine(TorchIOEngine):
    """`torch.save` through a `FastFileWriter` over an aio handle (DeepSpeed's `Torch_FastIO_Engine`)."""

    name = "torch_fastio"

    def _setup(self, args: Any, device_id: int) -> None:
        handle = AsyncIOHandle(
            block_size=args.block_size,
            queue_depth=args.queue_depth,
            single_submit=args.single_submit,
            overlap_events=not args.sequential_requests,
            intra_op_parallelism=args.io_parallel or 1,
        )
        self.ctxt[HANDLE] = handle
        self.ctxt[USE_CPU_LOCKED_TENSOR] = not getattr(args, "gpu", False)
        if getattr(args, "gpu", False):
            self.ctxt[BUFFER] = torch.randint(
                high=128, size=(args.io_size,), dtype=torch.uint8, device=f"cuda:{device_id}"
            )
        else:
            self.ctxt[BUFFER] = handle.new_cpu_locked_tensor(args.io_size, torch.empty(0, dtype=torch.uint8))
            self.ctxt[BUFFER].copy_(torch.randint(high=128, size=(args.io_size,), dtype=torch.uint8))
        self.ctxt[FAST_IO_BUFFER] = handle.new_cpu_locked_tensor(args.fast_io_size, torch.empty(0, dtype=torch.uint8))

    def _save(self, path: str) -> None:
        config = FastFileWriterConfig(
            dnvme_handle=self.ctxt[HANDLE],
            pinned_tensor=self.ctxt[FAST_IO_BUFFER],
            double_buffer=True,
            num_parallel_writers=1,
            writer_rank=0,
            global_rank=0,
        )
        writer = FastFileWriter(path, config)
        try:
            torch.save(self.ctxt[BUFFER], writer, _use_new_zipfile_serialization=self.zipfile_serialization)  # type: ignore[arg-type]
        finally:
            writer.close()  # the timed part ends with the bytes flushed to the file

    def fini(self) -> None:
        handle = self.ctxt.get(HANDLE)
        if handle is not None:
            locked = [FAST_IO_BUFFER, *([BUFFER] if self.ctxt[USE_CPU_LOCKED_TENSOR] else [])]
            for key in locked:
                handle.free_cpu_locked_tensor(self.ctxt[key])
            self.ctxt[BUFFER] = self.ctxt[FAST_IO_BUFFER] = None
            handle.close()
            self.ctxt[HANDLE] = None


def run_torch_engine(
    engine: str,
    folder: str,
    io_size: int,
    *,
    loops: int,
    warmup_loops: int,
    validate: bool = False,
    **settings: Any,
) -> list[float]:
    """Seconds of each timed write by `engine` (after `warmup_loops` untimed ones); the file is removed after.

    `settings`: the handle's and writer's `ds_io` settings (block_size, queue_depth, single_submit,
    sequential_requests, io_parallel, fast_io_size, torch_legacy_save).

    Raises:
        ValueError: an engine other than `torch_io` / `torch_fastio`; with `validate`, a file that does not load
            back to the buffer.
    """
    if engine not in TORCH_ENGINES:
        raise ValueError(f"--engine {engine!r} is not one of {TORCH_ENGINES}")
    args = types.SimpleNamespace(mapping_list=[(0, folder)], io_size=io_size, gpu=False, **settings)
    task = (TorchIOEngine if engine == "torch_io" else TorchFastIOEngine)(args, 0, False)
    path = task.ctxt[FILE]
    try:
        seconds = [task.write() for _ in range(warmup_loops + loops)][warmup_loops:]
        if validate and not torch.equal(torch.load(path, weights_only=True), task.ctxt[BUFFER]):
            raise ValueError(f"--validate: {path} does not load back to the buffer that was saved")
    finally:
        task.fini()
        if os.path.exists(path):
            os.remove(path)
    return seconds
