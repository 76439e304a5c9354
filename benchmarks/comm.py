"""Collective bus bandwidth on 2 gloo ranks: ds_comm wrappers vs raw torch.distributed, side by side.

Run: python benchmarks/comm.py [--world 2] [--max-mib 64]
Prints, per op and message size, the median latency and bus bandwidth of each, and the ratio
ds/raw of the latencies (1.00 = no overhead). Target: ratio <= 1.02 at >= 1 MiB, logger off.
Rounds interleave the two implementations so machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import ds_comm
from ds_comm.testing import run_ranks

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _callables(op: str, numel: int, world: int):
    x = torch.ones(numel)
    if op == "all_reduce":
        return (lambda: ds_comm.all_reduce(x)), (lambda: dist.all_reduce(x)), numel * 4
    if op == "all_gather_into_tensor":
        shard, out = torch.ones(numel // world), torch.empty(numel)
        return (lambda: ds_comm.all_gather_into_tensor(out, shard)), \
               (lambda: dist.all_gather_into_tensor(out, shard)), numel * 4
    out = torch.empty(numel // world)
    return (lambda: ds_comm.reduce_scatter_tensor(out, x)), (lambda: dist.reduce_scatter_tensor(out, x)), numel * 4


def _time(fn, iters: int) -> float:
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _bench(rank: int, world: int, sizes: list[int], rounds: int) -> list[tuple[str, int, float, float]]:
    rows = []
    for op in OPS:
        for size_bytes in sizes:
            numel = max(world, size_bytes // 4)
            ours, raw, nbytes = _callables(op, numel, world)
            iters = max(3, min(200, (8 << 20) // max(size_bytes, 1)))
            ours(), raw()  # warm up
            t_ours, t_raw = [], []
            for _ in range(rounds):
                t_raw.append(_time(raw, iters))
                t_ours.append(_time(ours, iters))
            rows.append((op, nbytes, statistics.median(t_raw), statistics.median(t_ours)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", default="", metavar="PATH", help="also write the figures as JSON rows")
    args = parser.parse_args()
    sizes = []
    size = 1024
    while size <= args.max_mib << 20:
        sizes.append(size)
        size *= 4
    rows = run_ranks(args.world, _bench, sizes=sizes, rounds=args.rounds, timeout_s=1800)[0]
    print(f"collectives on {args.world} gloo ranks, median of {args.rounds} interleaved rounds, comms logger off")
    print(f"{'op':<24}{'size':>10}{'raw ms':>10}{'ds ms':>10}{'raw busbw GB/s':>16}{'ds busbw GB/s':>15}"
          f"{'ds/raw':>8}")
    worst_large = 0.0
    for op, nbytes, t_raw, t_ours in rows:
        factor = _bus_factor(op, args.world)
        ratio = t_ours / t_raw
        if nbytes >= 1 << 20:
            worst_large = max(worst_large, ratio)
        label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        print(f"{op:<24}{label:>10}{t_raw * 1e3:>10.3f}{t_ours * 1e3:>10.3f}"
              f"{nbytes * factor / t_raw / 1e9:>16.3f}{nbytes * factor / t_ours / 1e9:>15.3f}{ratio:>8.3f}")
    print(f"worst ds/raw latency ratio at >= 1 MiB: {worst_large:.3f} (target <= 1.02)")
    if args.json:  # the rows benchmarks/results.py collects: latency at >= 1 MiB (the target's range)
        import _report

        _report.write_rows(args.json, [
            _report.Row("comm", f"{op} {nbytes >> 20} MiB latency, {args.world} ranks, median of {args.rounds}",
                        t_ours * 1e3, "ms", "raw torch.distributed", t_raw * 1e3, target="<= 1.02")
            for op, nbytes, t_raw, t_ours in rows if nbytes >= 1 << 20])


if __name__ == "__main__":
    main()
