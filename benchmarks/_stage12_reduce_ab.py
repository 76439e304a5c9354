"""A/B of ZeRO-1/2's two-rank gradient reduction: the peer's piece summed into the own one as it is received
(`ds_zero._stage12.reduce`, [Note: two ranks sum as they receive]) against receiving it into a buffer and
adding both afterwards, in the same two processes, alternating iteration by iteration.

Run by hand (not part of `results.py`): `python benchmarks/_stage12_reduce_ab.py [--numel N] [--bucket B]`.
Prints each rank's median process CPU time per reduction of an `N`-element fp32 gradient (the 21M GPT of
`zero_deepspeed.py` by default) cut into `B`-element buckets, at stage 1 (the own partition of the flat
gradient is the accumulator) and stage 2 (a separate fp32 partition accumulates).
"""

from __future__ import annotations

import argparse
import resource
import statistics

import torch

from ds_comm.testing import run_ranks


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _reduce_times(rank: int, world: int, *, numel: int, bucket: int, iters: int) -> dict[str, list[float]]:
    import ds_comm
    from ds_zero._stage12.reduce import RangeReducer

    reducer = RangeReducer(None, use_reduce_scatter=True, predivide_factor=1.0)
    part = numel // world
    grads = torch.randn(part * world, generator=torch.Generator().manual_seed(rank))
    separate = torch.zeros(part)
    times: dict[str, list[float]] = {}
    for it in range(iters):
        summed = it % 2 == 0
        for stage, in_place in ((1, True), (2, False)):
            reducer._sum_in_exchange = summed
            g = grads.clone()
            acc = g[rank * part : (rank + 1) * part] if in_place else separate
            ds_comm.barrier()
            start = _cpu_s()
            in_flight = []
            for lo in range(0, g.numel(), bucket):
                hi = min(lo + bucket, g.numel())
                in_flight.append(reducer.launch(g[lo:hi], lo, hi, part))
                if len(in_flight) > 2:
                    reducer.complete(in_flight.pop(0), acc, part, in_place=in_place)
            for item in in_flight:
                reducer.complete(item, acc, part, in_place=in_place)
            key = f"stage {stage}, {'summed while received' if summed else 'received, then added'}"
            times.setdefault(key, []).append(_cpu_s() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=21_000_000)
    parser.add_argument("--bucket", type=int, default=25 * 2**20 // 4)
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    results = run_ranks(2, _reduce_times, numel=args.numel, bucket=args.bucket, iters=args.iters, timeout_s=600)
    print(f"{args.numel} fp32 gradient elements, buckets of {args.bucket}, 2 gloo ranks; median over {args.iters // 2}")
    for key in results[0]:
        per_rank = [statistics.median(r[key][1:]) * 1e3 for r in results]
        print(f"  {key:<40} " + "  ".join(f"rank {i}: {ms:6.1f} ms" for i, ms in enumerate(per_rank)))


if __name__ == "__main__":
    main()
