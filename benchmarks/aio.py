"""Write and read bandwidth of the async_io op vs torch.save/torch.load, numpy tofile/fromfile and dd.

All contenders move the same number of bytes to and from files in one directory (default /tmp),
interleaved rep by rep so that disk noise hits each alike; the table shows median GB/s (with the
range over reps) and the ratio to dd with the same block size (O_DIRECT contenders against
`dd oflag=direct`/`iflag=direct`, buffered ones against buffered dd).

- Buffered writes end with fsync (dd: conv=fsync), so every write figure is data on the device,
  not in the page cache.
- Before every buffered read the file's pages are evicted with posix_fadvise(DONTNEED) (no
  privileges needed, other processes' caches untouched), so buffered reads come from the device
  too. O_DIRECT reads bypass the cache anyway.

Target: the op with O_DIRECT >= 80% of dd's O_DIRECT bandwidth, write and read.

    python benchmarks/aio.py [--dir /tmp] [--size-mib 128] [--reps 5] [--block-size 1048576]
                             [--queue-depth 8] [--threads 1] [--json rows.json]
    python benchmarks/aio.py --step [--dir /tmp] [--json rows.json]   # ZeRO-3 step: NVMe vs CPU offload
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

try:
    import numpy as np
except ModuleNotFoundError:  # torch does not require numpy; the numpy contender is then left out
    np = None

from ds_ops.aio import AsyncIOHandle

GB = 1e9
TARGET = 0.8


def _evict(path: Path) -> None:
    """Drop `path`'s pages from the page cache (they are clean after fsync)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dd(args: list[str]) -> float:
    """Seconds dd reports for its copy (its own clock, not process start-up)."""
    result = subprocess.run(["dd", *args], capture_output=True, text=True, timeout=600, check=True)
    match = re.search(r"copied, ([0-9.e+-]+) s", result.stderr)
    if match is None:
        raise RuntimeError(f"cannot parse dd's output: {result.stderr!r}")
    return float(match.group(1))


class Contenders:
    """One write and one read function per contender; each returns its seconds."""

    def __init__(self, directory: Path, nbytes: int, block_size: int, queue_depth: int, threads: int) -> None:
        self.dir = directory
        self.nbytes = nbytes
        self.block_size = block_size
        self.direct = AsyncIOHandle(block_size, queue_depth, intra_op_parallelism=threads, use_o_direct=True)
        self.buffered = AsyncIOHandle(block_size, queue_depth, intra_op_parallelism=threads, use_o_direct=False)
        self.engine = self.direct.engine
        numel = nbytes // 4
        self.source = self.direct.new_cpu_locked_tensor(numel, torch.empty(0))
        self.source.copy_(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
        self.target = self.direct.new_cpu_locked_tensor(numel, torch.empty(0))
        self.target.zero_()
        self.plain = self.source.clone()  # torch.save writes a tensor's whole storage: give it an exact one
        self.array = self.source.numpy() if np is not None else None
        self.count = nbytes // block_size
        # dd writes these same bytes (from the page cache), not /dev/zero: a virtual disk may store zero
        # blocks as holes and read them back without touching the device, which flatters dd's reads.
        self.dd_source = directory / "dd_source.bin"
        self.dd_source.write_bytes(self.source.numpy().tobytes())

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.bin"

    def run(self, name: str, kind: str) -> float:
        return getattr(self, f"{kind}_{name}")(self.path(name))

    @staticmethod
    def _timed(fn: Callable[[], object]) -> float:
        started = time.perf_counter()
        fn()
        return time.perf_counter() - started

    # O_DIRECT contenders -------------------------------------------------------------------------
    def write_op_direct(self, path: Path) -> float:
        return self._timed(lambda: self.direct.sync_pwrite(self.source, path))

    def read_op_direct(self, path: Path) -> float:
        seconds = self._timed(lambda: self.direct.sync_pread(self.target, path))
        assert torch.equal(self.target, self.source), "op O_DIRECT read back different bytes"
        return seconds

    def write_dd_direct(self, path: Path) -> float:
        return _dd(
            [f"if={self.dd_source}", f"of={path}", f"bs={self.block_size}", f"count={self.count}", "oflag=direct"]
        )

    def read_dd_direct(self, path: Path) -> float:
        return _dd([f"if={path}", "of=/dev/null", f"bs={self.block_size}", f"count={self.count}", "iflag=direct"])

    # buffered contenders (writes end with fsync; reads start from an evicted cache) ------------------
    def write_op_buffered(self, path: Path) -> float:
        return self._timed(lambda: (self.buffered.sync_pwrite(self.source, path), _fsync(path)))

    def read_op_buffered(self, path: Path) -> float:
        _evict(path)
        seconds = self._timed(lambda: self.buffered.sync_pread(self.target, path))
        assert torch.equal(self.target, self.source), "op buffered read back different bytes"
        return seconds

    def write_torch(self, path: Path) -> float:
        return self._timed(lambda: (torch.save(self.plain, path), _fsync(path)))

    def read_torch(self, path: Path) -> float:
        _evict(path)
        return self._timed(lambda: torch.load(path, weights_only=True))

    def write_numpy(self, path: Path) -> float:
        return self._timed(lambda: (self.array.tofile(path), _fsync(path)))

    def read_numpy(self, path: Path) -> float:
        _evict(path)
        return self._timed(lambda: np.fromfile(path, dtype=np.float32))

    def write_dd_buffered(self, path: Path) -> float:
        return _dd([f"if={self.dd_source}", f"of={path}", f"bs={self.block_size}", f"count={self.count}", "conv=fsync"])

    def read_dd_buffered(self, path: Path) -> float:
        _evict(path)
        return _dd([f"if={path}", "of=/dev/null", f"bs={self.block_size}", f"count={self.count}"])


NAMES = {
    "op_direct": "ds aio O_DIRECT",
    "dd_direct": "dd O_DIRECT",
    "op_buffered": "ds aio buffered",
    "torch": "torch.save/load",
    "numpy": "numpy tofile/fromfile",
    "dd_buffered": "dd buffered",
}
if np is None:
    del NAMES["numpy"]
BASELINE = {
    "op_direct": "dd_direct",
    "dd_direct": "dd_direct",
    "op_buffered": "dd_buffered",
    "torch": "dd_buffered",
    "numpy": "dd_buffered",
    "dd_buffered": "dd_buffered",
}


def measure(contenders: Contenders, reps: int) -> dict[tuple[str, str], list[float]]:
    """Seconds per rep for each (contender, "write"|"read"); rep 0 warms up and is dropped. The
    order rotates each rep, so no contender always runs right after the same one."""
    times: dict[tuple[str, str], list[float]] = {(n, k): [] for n in NAMES for k in ("write", "read")}
    names = list(NAMES)
    for rep in range(reps + 1):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            for kind in ("write", "read"):
                seconds = contenders.run(name, kind)
                if rep:
                    times[(name, kind)].append(seconds)
            contenders.path(name).unlink()
    return times


def rows_and_table(times: dict[tuple[str, str], list[float]], nbytes: int, label: str) -> tuple[list[dict], str]:
    """Median GB/s with its range over reps, and the ratio to the baseline as the median of the per-rep
    ratios (each rep's contender against the same rep's baseline: robust to a disk whose speed drifts)."""
    gbs = {key: [nbytes / GB / s for s in seconds] for key, seconds in times.items()}
    header = (
        f"{'contender':<24} {'write GB/s':>10} {'(min-max)':>11} {'read GB/s':>10} {'(min-max)':>11} "
        f"{'write/dd':>9} {'read/dd':>8}  baseline"
    )
    lines = [header, "-" * len(header)]
    rows = []
    for name, title in NAMES.items():
        base = BASELINE[name]
        cells, ratios = [], []
        for kind in ("write", "read"):
            values = gbs[(name, kind)]
            cells.append(f"{statistics.median(values):>10.2f} {f'({min(values):.2f}-{max(values):.2f})':>11}")
            ratios.append(statistics.median(v / b for v, b in zip(values, gbs[(base, kind)], strict=True)))
        lines.append(f"{title:<24} {cells[0]} {cells[1]} {ratios[0]:>9.2f} {ratios[1]:>8.2f}  {NAMES[base]}")
        if name == base:
            continue
        for kind, ratio in zip(("write", "read"), ratios, strict=True):
            rows.append(
                {
                    "figure": f"aio {kind} bandwidth: {title} ({label})",
                    "value": round(statistics.median(gbs[(name, kind)]), 3),
                    "unit": "GB/s",
                    "baseline": NAMES[base],
                    "baseline_value": round(statistics.median(gbs[(base, kind)]), 3),
                    "ratio": round(ratio, 3),
                    "target": f">= {TARGET}" if name == "op_direct" else None,
                }
            )
    return rows, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--size-mib", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--block-size", type=int, default=1 << 20)
    parser.add_argument("--queue-depth", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="intra_op_parallelism")
    parser.add_argument("--json", type=Path, help="write result rows here")
    parser.add_argument(
        "--step",
        action="store_true",
        help="instead: stage-3 step time with NVMe offload vs CPU offload vs none, 2 gloo ranks "
        "(benchmarks/_nvme_step.py; swap files under --dir)",
    )
    args = parser.parse_args()
    if args.step:
        import _nvme_step  # sibling module of this script

        aio = {"block_size": args.block_size, "queue_depth": args.queue_depth, "intra_op_parallelism": args.threads}
        rows, table = _nvme_step.step_rows(directory=str(args.dir), aio=aio)
        print(f"torch {torch.__version__}; median step of the slower rank, modes interleaved step by step")
        print(table)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2) + "\n")
        return
    if shutil.which("dd") is None:
        raise SystemExit("dd not found")
    nbytes = args.size_mib << 20
    if nbytes % args.block_size:
        raise SystemExit(f"--size-mib {args.size_mib} must be a multiple of the block size {args.block_size}")
    with tempfile.TemporaryDirectory(prefix="ds_aio_bench_", dir=args.dir) as tmp:
        contenders = Contenders(Path(tmp), nbytes, args.block_size, args.queue_depth, args.threads)
        if not contenders.direct.uses_o_direct(Path(tmp) / "probe.bin"):
            raise SystemExit(f"{args.dir} does not take O_DIRECT; pick another --dir")
        times = measure(contenders, args.reps)
    label = (
        f"{args.size_mib} MiB, block {args.block_size}, queue_depth {args.queue_depth}, "
        f"threads {args.threads}, engine {contenders.engine}, dir {args.dir}"
    )
    rows, table = rows_and_table(times, nbytes, label)
    print(
        f"torch {torch.__version__}; {label}; median of {args.reps} interleaved reps (ratios: median of per-rep ratios)"
    )
    print(
        "buffered writes end with fsync; buffered reads start with the file evicted from the page cache"
        + ("" if np is not None else "; numpy not installed: its contender is left out")
    )
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
