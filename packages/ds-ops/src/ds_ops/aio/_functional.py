"""DeepSpeed's functional aio calls, `aio_read` / `aio_write` (`AsyncIOBuilder().load().aio_read(...)`).

One blocking read or write of a whole file through a handle made for the call, with the call's block size,
queue depth and submission settings; what DeepSpeed's `ds_io --engine aio_basic` times. DeepSpeed returns
-1 when it cannot open the file and prints the elapsed time; here the call returns 0 and a failure raises
`AioError` naming the file (the handle's error), and `validate` compares the bytes with a plain read.
"""

from __future__ import annotations

import os

import torch

from ds_ops.aio._deepspeed_handle import aio_handle

__all__ = ["aio_read", "aio_write"]


def _run(
    write: bool,
    buffer: torch.Tensor,
    filename: str | os.PathLike[str],
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    handle = aio_handle(int(block_size), int(queue_depth), bool(single_submit), bool(overlap_events), 1)
    try:
        (handle.write if write else handle.read)(buffer, os.fspath(filename), bool(validate))
    finally:
        handle.close()
    return 0


def aio_read(
    buffer: torch.Tensor,
    filename: str | os.PathLike[str],
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """Read `filename` into `buffer` (its size: the file's), blocking; 0 when done.

    Raises:
        AioError: the read failed (missing file, short read), naming the file.
        ValueError: `validate` and the bytes differ from a plain read of the file.
    """
    return _run(False, buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate)


def aio_write(
    buffer: torch.Tensor,
    filename: str | os.PathLike[str],
    block_size: int,
    queue_depth: int,
    single_submit: bool,
    overlap_events: bool,
    validate: bool,
) -> int:
    """Write `buffer` to `filename`, blocking; 0 when done (`validate`: read back and compare).

    Raises:
        AioError: the write failed, naming the file.
        ValueError: `validate` and the file's bytes differ from `buffer`.
    """
    return _run(True, buffer, filename, block_size, queue_depth, single_submit, overlap_events, validate)
