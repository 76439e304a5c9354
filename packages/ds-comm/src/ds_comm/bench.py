"""`ds_bench`: collective bandwidth over the ranks this process was launched with, as a table per op.

    deepspeed ds_bench --all-reduce --scan              (or: torchrun --nproc-per-node 8 -m ds_comm.bench ...)

Ops: `--all-reduce`, `--all-gather`, `--all-to-all`, `--broadcast`, `--pt2pt` (rank 0 sends to rank 1), or all
of them when none is named. Message sizes are powers of two in bytes: `2^maxsize` alone, or every power from
`2^10` up to `2^maxsize` with `--scan`. Each size runs `--warmups` untimed and `--trials` timed calls; the
duration is the slowest rank's mean per call. Throughput (algorithmic bandwidth) is bytes moved per second as
nccl-tests defines it, and BusBW scales it by the op's link factor (2(n-1)/n for all_reduce, (n-1)/n for
all_gather and all_to_all, 1 for broadcast and pt2pt), so figures compare across world sizes. Started
without a launcher, the benchmark runs on a world of one rank and says so.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import torch

from ds_comm._byte_units import format_bytes
from ds_comm._comms_logger import bus_factor
from ds_comm._dist_init import init_distributed
from ds_comm.accelerator import get_accelerator
from ds_comm.collectives import (
    ReduceOp,
    all_gather_into_tensor,
    all_reduce,
    all_to_all_single,
    barrier,
    broadcast,
    get_rank,
    get_world_size,
    recv,
    send,
)

__all__ = ["BenchRow", "OPS", "main", "run_benchmark"]

OPS = ("all_reduce", "all_gather", "all_to_all", "broadcast", "pt2pt")
_DTYPES = {"float": torch.float32, "half": torch.float16, "bfloat16": torch.bfloat16}
_MIN_EXPONENT = 10


@dataclasses.dataclass(frozen=True)
class BenchRow:
    """One op at one message size: `size_bytes` is the per-rank message (the gathered output for all_gather)."""

    op: str
    size_bytes: int
    numel: int
    trials: int
    duration_s: float
    algbw_bytes_s: float
    busbw_bytes_s: float


def _op_call(op: str, numel: int, dtype: torch.dtype, world: int, rank: int) -> tuple[Callable[[], object], int]:
    """A zero-argument call doing one `op` on `numel` elements, and the bytes it counts as moved."""
    device = get_accelerator().device()
    element = torch.tensor([], dtype=dtype).element_size()
    if op == "all_reduce":
        t = torch.ones(numel, dtype=dtype, device=device)
        return (lambda: all_reduce(t, op=ReduceOp.SUM)), numel * element
    if op == "all_gather":
        per_rank = max(numel // world, 1)
        src = torch.ones(per_rank, dtype=dtype, device=device)
        out = torch.empty(per_rank * world, dtype=dtype, device=device)
        return (lambda: all_gather_into_tensor(out, src)), out.numel() * element
    if op == "all_to_all":
        count = max(numel // world, 1) * world
        src, out = (torch.ones(count, dtype=dtype, device=device), torch.empty(count, dtype=dtype, device=device))
        return (lambda: all_to_all_single(out, src)), count * element
    if op == "broadcast":
        t = torch.ones(numel, dtype=dtype, device=device)
        return (lambda: broadcast(t, src=0)), numel * element
    if op == "pt2pt":
        t = torch.ones(numel, dtype=dtype, device=device)
        if world < 2:
            raise ValueError("--pt2pt needs at least 2 ranks (rank 0 sends to rank 1)")
        call = (lambda: send(t, 1)) if rank == 0 else (lambda: recv(t, 0)) if rank == 1 else (lambda: None)
        return call, numel * element
    raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")


def _time(op: str, numel: int, dtype: torch.dtype, trials: int, warmups: int) -> BenchRow:
    world, rank = get_world_size(), get_rank()
    call, size_bytes = _op_call(op, numel, dtype, world, rank)
    accelerator = get_accelerator()
    for _ in range(warmups):
        call()
    accelerator.synchronize()
    barrier()
    start = time.perf_counter()
    for _ in range(trials):
        call()
    accelerator.synchronize()
    elapsed = torch.tensor([(time.perf_counter() - start) / trials], dtype=torch.float64, device=accelerator.device())
    all_reduce(elapsed, op=ReduceOp.MAX)  # the slowest rank sets the pace of a collective
    duration = float(elapsed.item())
    algbw = size_bytes / duration
    factor = (
        1.0
        if op == "pt2pt"
        else bus_factor({"all_gather": "all_gather_into_tensor", "all_to_all": "all_to_all_single"}.get(op, op), world)
    )
    return BenchRow(op, size_bytes, numel, trials, duration, algbw, algbw * factor)


def run_benchmark(
    ops: Sequence[str],
    sizes_bytes: Sequence[int],
    *,
    trials: int = 50,
    warmups: int = 5,
    dtype: torch.dtype = torch.float32,
) -> list[BenchRow]:
    """Time each op at each size on the current process group; every rank returns the same rows.

    Raises:
        ValueError: an unknown op, a size smaller than one element, non-positive trials, or pt2pt on one rank.
    """
    if trials < 1 or warmups < 0:
        raise ValueError(f"--trials must be >= 1 and --warmups >= 0, got {trials} and {warmups}")
    element = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for op in ops:
        for size in sizes_bytes:
            if size < element:
                raise ValueError(f"message size {size} bytes is smaller than one {dtype} element")
            rows.append(_time(op, size // element, dtype, trials, warmups))
    return rows


def format_table(rows: Sequence[BenchRow], *, bw_unit: str = "Gbps", raw: bool = False) -> str:
    """One block per op: size, trials x elements, duration, throughput and bus bandwidth."""
    scale = 8 / 1e9 if bw_unit == "Gbps" else 1 / 1e9
    lines = []
    for op in dict.fromkeys(r.op for r in rows):
        lines.append(f"---- Performance of {op} on {get_world_size()} ranks ----")
        lines.append(
            f"{'Size (Bytes)':<20}{'Description':<25}{'Duration':<18}"
            f"{f'Throughput ({bw_unit})':<24}{f'BusBW ({bw_unit})':<20}"
        )
        for r in (r for r in rows if r.op == op):
            size = str(r.size_bytes) if raw else format_bytes(r.size_bytes)
            duration = f"{r.duration_s:.6f} s" if raw else _format_duration(r.duration_s)
            lines.append(
                f"{size:<20}{f'{r.trials}x{r.numel}':<25}{duration:<18}"
                f"{r.algbw_bytes_s * scale:<24.3f}{r.busbw_bytes_s * scale:<20.3f}"
            )
    return "\n".join(line.rstrip() for line in lines)


def _format_duration(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.3f} us"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds_bench", description="Collective bandwidth over the launched ranks.")
    p.add_argument("--local_rank", type=int, default=None, help="set by the launcher; ignored")
    p.add_argument("--trials", type=int, default=50, help="timed calls per size (default %(default)s)")
    p.add_argument("--warmups", type=int, default=5, help="untimed calls per size (default %(default)s)")
    p.add_argument("--maxsize", type=int, default=24, help="largest message, as a power of 2 bytes (default 24)")
    p.add_argument("--scan", action="store_true", help=f"every power of 2 from 2^{_MIN_EXPONENT} to 2^maxsize")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="float", help="element type (default float)")
    p.add_argument("--bw-unit", choices=["Gbps", "GBps"], default="Gbps", help="bandwidth unit (default Gbps)")
    p.add_argument("--raw", action="store_true", help="print sizes in bytes and durations in seconds")
    for op in OPS:
        p.add_argument(f"--{op.replace('_', '-')}", dest=op, action="store_true", help=f"run {op}")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `ds_bench`; rank 0 prints the table. Returns the exit status."""
    args = _parser().parse_args(argv)
    if args.maxsize < _MIN_EXPONENT and args.scan:
        print(f"ds_bench: --maxsize must be >= {_MIN_EXPONENT} with --scan, got {args.maxsize}", file=sys.stderr)
        return 2
    init_distributed(verbose=False)
    world = get_world_size()
    ops = [op for op in OPS if getattr(args, op)] or [op for op in OPS if op != "pt2pt" or world > 1]
    exponents = range(_MIN_EXPONENT, args.maxsize + 1) if args.scan else [args.maxsize]
    try:
        rows = run_benchmark(
            ops, [2**e for e in exponents], trials=args.trials, warmups=args.warmups, dtype=_DTYPES[args.dtype]
        )
    except ValueError as err:
        print(f"ds_bench: {err}", file=sys.stderr)
        return 2
    if get_rank() == 0:
        if world == 1:
            print("ds_bench: running on 1 rank (start it under `deepspeed` or torchrun to measure more)")
        print(format_table(rows, bw_unit=args.bw_unit, raw=args.raw))
    return 0


if __name__ == "__main__":
    sys.exit(main())
