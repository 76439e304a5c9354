"""`ds_io`: time reads or writes of one file through the aio op, with DeepSpeed's `ds_io` flags.

    ds_io --folder /nvme/scratch --io_size 400M [--read] [--block_size 1M] [--queue_depth 32]
          [--single_submit] [--sequential_requests] [--io_parallel N] [--loops 3] [--warmup_loops 1] [--validate]
          [--engine aio_handle|aio_basic|torch_io|torch_fastio] [--fast_io_size 64M] [--torch_legacy_save]

A write test writes `io_size` bytes of a pinned buffer to `<folder>/ds_aio_<io_size>B.bin` per loop; a read
test first writes that file and then reads it back. Each loop's bytes and seconds give the bandwidth in
GB/s (1e9 bytes); the summary reports the best and the mean over the timed loops, after DeepSpeed's
`Task/E2E <Read|Write> Latency/Speed` lines for the best loop (GB/sec there is 1024**3 bytes, as DeepSpeed
prints it), which `ds_ops.nvme_stats` (`parse_nvme_stats`) reads back from sweep logs. `--validate` compares
what a read brings back with what was written. `--engine torch_io` / `torch_fastio` time `torch.save` of
the buffer instead, plain or through the FastPersist writer (writes only, as in DeepSpeed; `ds_ops.nvme_torch_io`).
`--engine aio_basic` times DeepSpeed's functional calls (`aio_read` / `aio_write`: a handle per call, a write
to a removed file each loop, as DeepSpeed's basic engine does) instead of one handle's.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
import time
from collections.abc import Sequence

import torch

from ds_ops.aio import AsyncIOHandle, aio_read, aio_write
from ds_ops.nvme_stats import report_lines
from ds_ops.nvme_torch_io import TORCH_ENGINES, run_torch_engine

__all__ = ["IoResult", "ds_io_main", "parse_size", "run_io"]

_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
ENGINES = ("aio_handle", "aio_basic", *TORCH_ENGINES)
"""`--engine` choices, DeepSpeed's."""


def parse_size(text: str | int) -> int:
    """`"400M"` -> 419430400; K, M and G are powers of 1024 (DeepSpeed's suffixes); a bare number is bytes.

    Raises:
        ValueError: not a positive size.
    """
    if isinstance(text, int):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text).upper())
        if match is None:
            raise ValueError(f"size {text!r} is not a number with an optional K, M or G suffix (e.g. 400M)")
        value = int(match.group(1)) * _UNITS[match.group(2)]
    if value <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return value


@dataclasses.dataclass(frozen=True)
class IoResult:
    """One configuration's timed loops: bytes per loop and each loop's seconds."""

    read: bool
    num_bytes: int
    seconds: tuple[float, ...]

    @property
    def best_gbps(self) -> float:
        return self.num_bytes / min(self.seconds) / 1e9

    @property
    def mean_gbps(self) -> float:
        return self.num_bytes / (sum(self.seconds) / len(self.seconds)) / 1e9


def run_io(
    folder: str | os.PathLike[str],
    io_size: int,
    *,
    read: bool,
    block_size: int = 1 << 20,
    queue_depth: int = 32,
    single_submit: bool = False,
    overlap_events: bool = True,
    intra_op_parallelism: int = 1,
    loops: int = 3,
    warmup_loops: int = 1,
    validate: bool = False,
    engine: str = "aio_handle",
    fast_io_size: int = 64 << 20,
    torch_legacy_save: bool = False,
) -> IoResult:
    """Time `loops` reads or writes of `io_size` bytes of one file in `folder` through an `AsyncIOHandle`.

    Raises:
        ValueError: `folder` is not a directory, or a count is not positive; with `validate`, the bytes read back
            differ (the message names the first one).
    """
    if not os.path.isdir(folder):
        raise ValueError(f"--folder {os.fspath(folder)!r} is not a directory")
    if loops < 1 or warmup_loops < 0:
        raise ValueError(f"--loops must be >= 1 and --warmup_loops >= 0, got {loops} and {warmup_loops}")
    if engine not in ENGINES:
        raise ValueError(f"--engine {engine!r} is not one of {', '.join(ENGINES)}")
    if read and engine in TORCH_ENGINES:
        raise ValueError(f"--engine {engine} times writes only (as DeepSpeed's); drop --read")
    if engine in TORCH_ENGINES:
        seconds = run_torch_engine(
            engine,
            os.fspath(folder),
            io_size,
            loops=loops,
            warmup_loops=warmup_loops,
            validate=validate,
            block_size=block_size,
            queue_depth=queue_depth,
            single_submit=single_submit,
            sequential_requests=not overlap_events,
            io_parallel=intra_op_parallelism,
            fast_io_size=fast_io_size,
            torch_legacy_save=torch_legacy_save,
        )
        return IoResult(read=False, num_bytes=io_size, seconds=tuple(seconds))
    path = os.path.join(folder, f"ds_aio_{io_size}B.bin")
    handle = AsyncIOHandle(
        block_size=block_size,
        queue_depth=queue_depth,
        single_submit=single_submit,
        overlap_events=overlap_events,
        intra_op_parallelism=intra_op_parallelism,
    )
    try:
        buffer = handle.new_cpu_locked_tensor(io_size, torch.empty(0, dtype=torch.uint8))
        source = torch.randint(0, 256, (io_size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
        buffer.copy_(source)
        if read:
            handle.sync_pwrite(buffer, path)
        seconds = []
        for i in range(warmup_loops + loops):
            if read:
                buffer.zero_()
            elif engine == "aio_basic" and os.path.exists(path):
                os.remove(path)  # DeepSpeed's basic engine never overwrites a file in place
            start = time.perf_counter()
            if engine == "aio_basic":
                call = aio_read if read else aio_write
                call(buffer, path, block_size, queue_depth, single_submit, overlap_events, False)
            else:
                (handle.sync_pread if read else handle.sync_pwrite)(buffer, path)
            if i >= warmup_loops:
                seconds.append(time.perf_counter() - start)
        if validate:
            check = buffer if read else torch.empty_like(buffer)
            if not read:
                handle.sync_pread(check, path)
            _check_same(check, source, path)
        handle.free_cpu_locked_tensor(buffer)
    finally:
        handle.close()
        if os.path.exists(path):
            os.remove(path)
    return IoResult(read=read, num_bytes=io_size, seconds=tuple(seconds))


def _check_same(got: torch.Tensor, expected: torch.Tensor, path: str) -> None:
    differ = (got != expected).nonzero()
    if differ.numel():
        index = int(differ[0])
        raise ValueError(f"--validate: {path} byte {index} is {int(got[index])}, expected {int(expected[index])}")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_io", description="Benchmark file reads or writes through the aio op.")
    p.add_argument("--folder", required=True, help="directory to do the I/O in (on the NVMe device to measure)")
    p.add_argument("--io_size", required=True, help="bytes per read or write, with K/M/G suffix")
    p.add_argument("--read", action="store_true", help="measure reads (default: writes)")
    p.add_argument("--block_size", default="1M", help="bytes per kernel request (default %(default)s)")
    p.add_argument("--queue_depth", type=int, default=32, help="requests in flight (default %(default)s)")
    p.add_argument("--single_submit", action="store_true", help="submit requests one at a time")
    p.add_argument(
        "--sequential_requests",
        action="store_true",
        help="refill the queue per batch instead of as requests complete (overlap_events off)",
    )
    p.add_argument("--io_parallel", type=int, default=1, help="worker threads per request (default %(default)s)")
    p.add_argument("--loops", type=int, default=3, help="timed repetitions (default %(default)s)")
    p.add_argument("--warmup_loops", type=int, default=1, help="untimed repetitions first (default %(default)s)")
    p.add_argument("--validate", action="store_true", help="check the bytes read back against those written")
    p.add_argument(
        "--engine", default="aio_handle", help=f"I/O engine, one of {', '.join(ENGINES)} (default %(default)s)"
    )
    p.add_argument("--fast_io_size", default="64M", help="torch_fastio's pinned buffer bytes (default %(default)s)")
    p.add_argument("--torch_legacy_save", action="store_true", help="torch engines: torch's legacy (non-zip) format")
    return p


#: Flags only DeepSpeed's multi-task `ds_io` reads: with any of them the run goes through its task runner.
_TASK_FLAGS = frozenset(
    (
        "--multi_process",
        "--folder_to_device_mapping",
        "--gpu",
        "--use_gds",
        "--slow_bounce_buffer",
        "--use_accelerator_pin_memory",
        "--include_warmup_time",
        "--different_file_each_iteration",
    )
)


def ds_io_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `ds_io`: run the benchmark and print one summary line; returns the exit status.

    With any of DeepSpeed's task flags (`--multi_process N`, `--folder_to_device_mapping DIR:DEV ...`, `--gpu`,
    ...) the run is DeepSpeed's: one process per task, in step (`ds_ops.nvme.io_engine`), its summary lines.
    """
    words = list(sys.argv[1:] if argv is None else argv)
    if any(word.split("=", 1)[0] in _TASK_FLAGS for word in words):
        from ds_ops.nvme.ds_aio_args import get_validated_args  # noqa: PLC0415 - the task runner's own path
        from ds_ops.nvme.io_engine import io_engine_multiprocessing  # noqa: PLC0415

        task_args = get_validated_args(words)
        return 0 if None not in io_engine_multiprocessing(task_args, task_args.read) else 1
    args = _parser().parse_args(words)
    try:
        io_size, block_size = parse_size(args.io_size), parse_size(args.block_size)
        result = run_io(
            args.folder,
            io_size,
            read=args.read,
            block_size=block_size,
            queue_depth=args.queue_depth,
            single_submit=args.single_submit,
            overlap_events=not args.sequential_requests,
            intra_op_parallelism=args.io_parallel,
            loops=args.loops,
            warmup_loops=args.warmup_loops,
            validate=args.validate,
            engine=args.engine,
            fast_io_size=parse_size(args.fast_io_size),
            torch_legacy_save=args.torch_legacy_save,
        )
    except ValueError as err:
        print(f"ds_io: {err}", file=sys.stderr)
        return 2
    kind = "read" if result.read else "write"
    for line in report_lines(result.read, io_size, min(result.seconds)):
        print(line)
    print(
        f"{kind} {io_size} bytes x {len(result.seconds)} loops: best {result.best_gbps:.3f} GB/s, "
        f"mean {result.mean_gbps:.3f} GB/s (block_size={block_size} queue_depth={args.queue_depth} "
        f"single_submit={args.single_submit} overlap_events={not args.sequential_requests} "
        f"io_parallel={args.io_parallel} engine={args.engine}){' validated' if args.validate else ''}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(ds_io_main())
