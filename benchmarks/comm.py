"""Collective latency and bus bandwidth on gloo ranks: ds_comm wrappers vs raw torch.distributed, side by side.

Run: python benchmarks/comm.py [--world 2] [--max-mib 64] [--rounds 15] [--json PATH]

Two measurements, because on a shared 2-core host the noise of one collective (+-10% and more)
is far larger than what a wrapper could add:

1. Paired latency per op and size: within each round the two implementations alternate call by
   call (ours, raw, ours, raw, ... with the order flipped every round), so drift and neighbours
   hit both alike; the figure is the median over rounds of the per-round ratio ds/raw.
2. The wrapper's fixed cost per call, measured where the collective itself is nearly free (a
   1-rank gloo group, 1-element tensor, many thousands of calls, blocks alternated), and expressed
   as a share of the raw 2-rank latency at each size >= 1 MiB. This is the overhead the wrapper
   adds, resolved to microseconds instead of drowned in the network's noise.

Target: ds/raw <= 1.02 at >= 1 MiB, comms logger off.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch
import torch.distributed as dist

import ds_comm
from ds_comm.testing import run_ranks

OPS = ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")
# The raw baseline calls the name the installed torch does not deprecate (torch 2.13: `*_single`), as
# ds_comm does: the deprecated names pay a warnings.warn per call.
RAW_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
RAW_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
TARGET = 1.02


def _bus_factor(op: str, n: int) -> float:
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _callables(op: str, numel: int, world: int):
    x = torch.ones(numel)
    if op == "all_reduce":
        return (lambda: ds_comm.all_reduce(x)), (lambda: dist.all_reduce(x))
    if op == "all_gather_into_tensor":
        shard, out = torch.ones(numel // world), torch.empty(numel)
        return (lambda: ds_comm.all_gather_into_tensor(out, shard)), (lambda: RAW_ALL_GATHER(out, shard))
    out = torch.empty(numel // world)
    return (lambda: ds_comm.reduce_scatter_tensor(out, x)), (lambda: RAW_REDUCE_SCATTER(out, x))


def _paired_round(ours, raw, iters: int, ours_first: bool) -> tuple[float, float]:
    """Alternate the two call by call; returns the mean seconds per call of each."""
    t_ours = t_raw = 0.0
    order = (ours, raw) if ours_first else (raw, ours)
    dist.barrier()
    for _ in range(iters):
        for fn in order:
            start = time.perf_counter()
            fn()
            elapsed = time.perf_counter() - start
            if fn is ours:
                t_ours += elapsed
            else:
                t_raw += elapsed
    return t_ours / iters, t_raw / iters


def _bench(rank: int, world: int, sizes: list[int], rounds: int) -> list[dict]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    rows = []
    for op in OPS:
        for size_bytes in sizes:
            numel = max(world, size_bytes // 4)
            ours, raw = _callables(op, numel, world)
            iters = max(3, min(100, (32 << 20) // max(size_bytes, 1)))
            ours(), raw()  # warm up
            lat_ours, lat_raw, ratios = [], [], []
            for r in range(rounds):
                a, b = _paired_round(ours, raw, iters, ours_first=r % 2 == 0)
                lat_ours.append(a)
                lat_raw.append(b)
                ratios.append(a / b)
            rows.append(
                {
                    "op": op,
                    "bytes": numel * 4,
                    "raw_s": statistics.median(lat_raw),
                    "ours_s": statistics.median(lat_ours),
                    "ratio": statistics.median(ratios),
                }
            )
    return rows


def _fixed_cost(rank: int, world: int, calls: int, blocks: int) -> dict:
    """Per-call cost of each implementation on a 1-rank group, where the collective costs microseconds."""
    warnings.filterwarnings("ignore", category=FutureWarning)
    x = torch.ones(1)
    out = {}
    for op, ours, raw in (("all_reduce", lambda: ds_comm.all_reduce(x), lambda: dist.all_reduce(x)),):
        for _ in range(200):
            ours(), raw()
        t_ours, t_raw = [], []
        for b in range(blocks):
            for fn, acc in ((ours, t_ours), (raw, t_raw)) if b % 2 == 0 else ((raw, t_raw), (ours, t_ours)):
                start = time.perf_counter()
                for _ in range(calls):
                    fn()
                acc.append((time.perf_counter() - start) / calls)
        out[op] = {"ours_s": statistics.median(t_ours), "raw_s": statistics.median(t_raw)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--max-mib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", default=None, help="also write the figures as JSON rows to this path")
    args = parser.parse_args()
    sizes = []
    size = 1024
    while size <= args.max_mib << 20:
        sizes.append(size)
        size *= 4
    fixed = run_ranks(1, _fixed_cost, calls=2000, blocks=11, timeout_s=600)[0]["all_reduce"]
    overhead_s = fixed["ours_s"] - fixed["raw_s"]
    rows = run_ranks(args.world, _bench, sizes=sizes, rounds=args.rounds, timeout_s=1800)[0]

    print(
        f"collectives on {args.world} gloo ranks, median of {args.rounds} rounds alternating call by call, "
        "comms logger off"
    )
    print(
        f"{'op':<24}{'size':>10}{'raw ms':>10}{'ds ms':>10}{'raw busbw GB/s':>16}{'ds busbw GB/s':>15}"
        f"{'ds/raw':>8}{'fixed share':>13}"
    )
    worst_paired = worst_fixed = 0.0
    for row in rows:
        factor = _bus_factor(row["op"], args.world)
        nbytes = row["bytes"]
        share = overhead_s / row["raw_s"]
        if nbytes >= 1 << 20:
            worst_paired = max(worst_paired, row["ratio"])
            worst_fixed = max(worst_fixed, share)
        label = f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"
        print(
            f"{row['op']:<24}{label:>10}{row['raw_s'] * 1e3:>10.3f}{row['ours_s'] * 1e3:>10.3f}"
            f"{nbytes * factor / row['raw_s'] / 1e9:>16.3f}{nbytes * factor / row['ours_s'] / 1e9:>15.3f}"
            f"{row['ratio']:>8.3f}{share * 100:>12.2f}%"
        )
    print(
        f"wrapper fixed cost per call (1-rank gloo group, 1 element): ds {fixed['ours_s'] * 1e6:.1f} us vs raw "
        f"{fixed['raw_s'] * 1e6:.1f} us -> +{overhead_s * 1e6:.1f} us per call"
    )
    print(
        f"at >= 1 MiB: worst paired ds/raw {worst_paired:.3f}; wrapper cost <= {worst_fixed * 100:.2f}% of the "
        f"collective (target: ratio <= {TARGET})"
    )
    if args.json:  # the rows benchmarks/results.py collects into RESULTS.md
        import _report

        large = [row for row in rows if row["bytes"] >= 1 << 20]
        by_share = max(large, key=lambda row: overhead_s / row["raw_s"])
        by_ratio = max(large, key=lambda row: row["ratio"])
        _report.write_rows(
            args.json,
            [
                _report.Row(
                    "comm",
                    f"wrapper cost (+{overhead_s * 1e6:.1f} us/call) on the fastest >= 1 MiB collective: "
                    f"{by_share['op']} {by_share['bytes'] >> 20} MiB, {args.world} ranks",
                    (by_share["raw_s"] + overhead_s) * 1e3,
                    "ms",
                    "raw torch.distributed",
                    by_share["raw_s"] * 1e3,
                    target=f"<= {TARGET}",
                ),
                _report.Row(
                    "comm",
                    f"worst paired latency at >= 1 MiB ({by_ratio['op']} {by_ratio['bytes'] >> 20} MiB, "
                    f"median of {args.rounds} rounds; host noise both ways)",
                    by_ratio["ours_s"] * 1e3,
                    "ms",
                    "raw torch.distributed",
                    by_ratio["raw_s"] * 1e3,
                    target=f"<= {TARGET}",
                ),
            ],
        )


if __name__ == "__main__":
    main()
