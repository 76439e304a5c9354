"""Pipeline parallelism on gloo: ds_pipe's 1F1B executor vs the sequential model vs torch.distributed.pipelining.

    python benchmarks/pipe.py                       # both modes, 4 stages, m = 4, 8, 16
    python benchmarks/pipe.py --mode sleep --batches 5

For each micro-batch count m it times one training batch (m micro-batches, forward, backward,
optimizer step) three ways: the whole model in one process with gradient accumulation
("sequential"), a 4-stage ds_pipe `PipelineExecutor`, and the same 4 stages under torch's
`Schedule1F1B`. Times are medians over `--batches` batches after 2 warm-up batches; a pipeline's batch
runs from the first rank's start to the last rank's end (the ranks start from one barrier; the barrier
that ends the batch is not timed, as the sequential side has none).

Two kinds of stage work:
- `compute`: Linear + GELU layers (real CPU math, one thread per rank). With fewer cores than
  ranks the stages cannot run at the same time, so this mode measures framework overhead and
  contention rather than pipeline overlap.
- `sleep`: a small Linear plus a fixed forward/backward delay (`time.sleep`, releasing the CPU), so
  stages overlap as on separate devices whatever the core count: it measures the schedule. As on a
  host with a CPU per rank, ds_comm's shared-memory p2p waits poll for 1 ms before they sleep
  (`DS_COMM_SHM_POLL_US=1000`, its default there; with 4 ranks on 2 CPUs it would not poll).

Columns: `speedup` = sequential time / pipeline time (ideal p*m/(m+p-1)); `bubble` = 1 - speedup/p,
the fraction of stage time lost (schedule bubble plus communication, measured from wall time);
`theory` = (p-1)/(m+p-1); `busy_bubble` (ds_pipe only) = 1 - (forward+backward time)/(batch time)
on the busiest stage, from the executor's own instruction timings. Each ds_pipe batch is also traced
and replayed with free communication (`_pipe_replay`), which splits its time into the 1F1B theory at
the traced mean stage time, what the stage times' variation adds, and what the transport adds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _pipe_replay
import _report
import torch
import torch.distributed as dist
from torch import nn

from ds_comm.testing import run_ranks
from ds_pipe import LayerSpec, PipelineExecutor, PipelineModule

WARMUP = 2
_POLL = {"DS_COMM_SHM_POLL_US": "1000"}  # sleep mode: the polling ds_comm does where each rank has a CPU


class Sleep(torch.autograd.Function):
    """Stand-in device work: `fwd_s` seconds in forward, twice that in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, fwd_s: float) -> torch.Tensor:
        ctx.fwd_s = fwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(2 * ctx.fwd_s)
        return grad, None


class Block(nn.Module):
    """One unit of stage work: Linear + GELU, plus a delay in sleep mode."""

    def __init__(self, hidden: int, sleep_s: float) -> None:
        super().__init__()
        self.lin, self.sleep_s = nn.Linear(hidden, hidden), sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.nn.functional.gelu(self.lin(x))
        return Sleep.apply(x, self.sleep_s) if self.sleep_s else x


def _blocks(args: argparse.Namespace) -> list[LayerSpec]:
    return [
        LayerSpec(Block, args.hidden, args.sleep_ms / 1000 / args.layers_per_stage)
        for _ in range(args.stages * args.layers_per_stage)
    ]


def _data(args: argparse.Namespace, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        (torch.randn(args.rows, args.hidden, generator=g), torch.randn(args.rows, args.hidden, generator=g))
        for _ in range(m)
    ]


def _time_batches(run_batch: Any, batches: int) -> list[float]:
    """Seconds per batch in one process (the sequential model)."""
    times = []
    for i in range(WARMUP + batches):
        start = time.perf_counter()
        run_batch()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return times


def _stamp_batches(run_batch: Any, batches: int) -> list[tuple[float, float]]:
    """(start, end) of each batch on this rank, every rank starting from the same barrier.

    The batch's time is then from the first rank's start to the last rank's end (`_batch_seconds`):
    `time.perf_counter` is CLOCK_MONOTONIC, one clock for every process of the host. A barrier after
    the batch keeps the ranks in step but stays out of the figure, as the sequential side has none.
    """
    stamps = []
    for i in range(WARMUP + batches):
        dist.barrier()
        start = time.perf_counter()
        run_batch()
        end = time.perf_counter()
        dist.barrier()
        if i >= WARMUP:
            stamps.append((start, end))
    return stamps


def _batch_seconds(results: list[dict[str, Any]]) -> float:
    """Median over batches of the first start to the last end, over every rank's stamps."""
    per_batch = zip(*(r["stamps"] for r in results), strict=True)
    return statistics.median(max(e for _, e in batch) - min(s for s, _ in batch) for batch in per_batch)


def sequential(args: argparse.Namespace, m: int) -> float:
    """Median batch time of the whole model in this process, gradient accumulation over m micro-batches."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[spec.build() for spec in _blocks(args)])
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = _data(args, m)

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        for x, y in data:
            (nn.functional.mse_loss(model(x), y) / m).backward()
        opt.step()

    return statistics.median(_time_batches(run, args.batches))


def ds_pipe_worker(rank: int, world_size: int, args: argparse.Namespace, m: int) -> dict[str, Any]:
    torch.manual_seed(0)
    module = PipelineModule(
        _blocks(args), num_stages=world_size, loss_fn=nn.functional.mse_loss, partition_method="uniform"
    )
    opt = torch.optim.SGD(module.parameters(), lr=1e-3)
    executor = PipelineExecutor(module, micro_batches=m, optimizer_step=opt.step)
    data = _data(args, m)
    busy: list[float] = []
    trace = _pipe_replay.record(executor)
    traces: list[_pipe_replay.Trace] = []

    def run() -> None:
        trace.clear()
        executor.train_batch(iter(data))
        traces.append(list(trace))
        t = executor.timings()
        busy.append(1 - (t.get("ForwardPass", 0) + t.get("BackwardPass", 0)) / t["batch"])

    stamps = _stamp_batches(run, args.batches)
    busy_bubble = statistics.median(busy[WARMUP:])
    return {"stamps": stamps, "busy_bubble": busy_bubble, "traces": traces[WARMUP:]}


def torch_worker(rank: int, world_size: int, args: argparse.Namespace, m: int) -> dict[str, Any]:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    torch.manual_seed(0)
    specs = _blocks(args)
    per = args.layers_per_stage
    stage_module = nn.Sequential(*[spec.build() for spec in specs[rank * per : (rank + 1) * per]])
    opt = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
    stage = PipelineStage(stage_module, rank, world_size, torch.device("cpu"))
    schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=nn.functional.mse_loss)
    data = _data(args, m)
    inputs = torch.cat([x for x, _ in data])
    target = torch.cat([y for _, y in data])

    def run() -> None:
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(inputs)
        elif rank == world_size - 1:
            schedule.step(target=target, losses=[])
        else:
            schedule.step()
        opt.step()

    return {"stamps": _stamp_batches(run, args.batches)}


def _row(
    mode: str, m: int, name: str, seconds: float, seq: float, args: argparse.Namespace, busy: float | None = None
) -> str:
    p = args.stages
    speedup = seq / seconds
    samples = m * args.rows / seconds
    theory = (p - 1) / (m + p - 1)
    bubble = "" if name == "sequential" else f"{1 - speedup / p:7.3f}"
    busy_text = "" if busy is None else f"{busy:7.3f}"
    return (
        f"{mode:8s} {m:3d}  {name:11s} {seconds * 1e3:9.2f} {samples:10.0f} {speedup:7.2f} "
        f"{bubble:>7s} {theory:7.3f} {busy_text:>7s}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=["compute", "sleep", "both"], default="both")
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--hidden", type=int, default=256, help="layer width in compute mode")
    parser.add_argument("--sleep-hidden", type=int, default=32, help="layer width in sleep mode")
    parser.add_argument("--rows", type=int, default=32, help="rows per micro-batch")
    parser.add_argument("--layers-per-stage", type=int, default=4)
    parser.add_argument("--sleep-ms", type=float, default=10.0, help="forward delay per stage (sleep mode)")
    parser.add_argument("--batches", type=int, default=5, help="timed batches per measurement")
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="measurements per setting, interleaved across implementations (median reported)",
    )
    _report.add_json_argument(parser)
    args = parser.parse_args()
    rows: list[_report.Row] = []
    modes = ["compute", "sleep"] if args.mode == "both" else [args.mode]
    print(
        f"{args.stages} stages x {args.layers_per_stage} blocks (compute: Linear({args.hidden}); sleep: "
        f"Linear({args.sleep_hidden}) + {args.sleep_ms} ms forward / {2 * args.sleep_ms} ms backward per stage), "
        f"{args.rows} rows per micro-batch, gloo on CPU, 1 thread per rank; medians of {args.repeats} x "
        f"{args.batches} batches; sleep mode: ds_pipe's p2p waits poll 1 ms first (DS_COMM_SHM_POLL_US=1000)"
    )
    print(
        f"{'mode':8s} {'m':>3s}  {'impl':11s} {'batch_ms':>9s} {'samples/s':>10s} {'speedup':>7s} "
        f"{'bubble':>7s} {'theory':>7s} {'busy_bb':>7s}"
    )
    ratios = []
    for mode in modes:
        sleeping = mode == "sleep"
        run_args = argparse.Namespace(
            **{
                **vars(args),
                "sleep_ms": args.sleep_ms if sleeping else 0.0,
                "hidden": args.sleep_hidden if sleeping else args.hidden,
            }
        )
        for m in args.micro_batches:
            seqs, ours, theirs, busy, replays, stage_s = [], [], [], [], [], []
            for _ in range(args.repeats):  # interleaved, so drifting machine load hits all three alike
                seqs.append(sequential(run_args, m))
                results = run_ranks(
                    args.stages, ds_pipe_worker, args=run_args, m=m, timeout_s=900, env=_POLL if sleeping else None
                )
                ours.append(_batch_seconds(results))
                busy.append(max(r["busy_bubble"] for r in results))
                for batch in zip(*(r["traces"] for r in results), strict=True) if sleeping else ():
                    replays.append(_pipe_replay.replay(list(batch)))
                    stage_s.append(_pipe_replay.mean_stage_seconds(list(batch)))
                results = run_ranks(args.stages, torch_worker, args=run_args, m=m, timeout_s=900)
                theirs.append(_batch_seconds(results))
            seq, ours_s, theirs_s = statistics.median(seqs), statistics.median(ours), statistics.median(theirs)
            print(_row(mode, m, "sequential", seq, seq, args))
            print(_row(mode, m, "ds_pipe", ours_s, seq, args, busy=statistics.median(busy)))
            print(_row(mode, m, "torch 1F1B", theirs_s, seq, args), flush=True)
            ratios.append((mode, m, theirs_s / ours_s))
            setting = f"{mode} m={m}, {args.stages} stages: batch time"
            rows.append(
                _report.Row(
                    "pipe",
                    setting,
                    ours_s * 1e3,
                    "ms",
                    "torch.distributed.pipelining 1F1B",
                    theirs_s * 1e3,
                    target="<= 1.0",
                )
            )
            if sleeping:  # stages overlap only when their work does not compete for cores (nor would a replay)
                replay_s, theory_s = statistics.median(replays), (m + args.stages - 1) * statistics.median(stage_s)
                print(
                    f"{'':8s} {'':3s}  ds_pipe replayed with free p2p: {replay_s * 1e3:.2f} ms; 1F1B theory at the "
                    f"traced mean stage time: {theory_s * 1e3:.2f} ms (stage-time variation adds "
                    f"{(replay_s - theory_s) * 1e3:.1f} ms, transport and executor {(ours_s - replay_s) * 1e3:.1f} ms)",
                    flush=True,
                )
                # paired: each round's pipeline batch against the same round's sequential one, so the host's
                # drift between rounds (its `time.sleep` overshoot moves both) cancels in the ratio
                bubble = statistics.median(1 - s / o / args.stages for s, o in zip(seqs, ours, strict=True))
                print(f"{'':8s} {'':3s}  bubble, paired median of {len(seqs)} rounds: {bubble:.3f}", flush=True)
                rows.append(
                    _report.Row(
                        "pipe",
                        f"{mode} m={m}: bubble fraction (1 - speedup/p), paired median of {len(seqs)} rounds",
                        bubble,
                        "",
                        "theory (p-1)/(m+p-1)",
                        (args.stages - 1) / (m + args.stages - 1),
                        target="<= 1.05",
                    )
                )
                rows.append(
                    _report.Row(
                        "pipe",
                        f"{mode} m={m}: ds_pipe batch replayed with free p2p (the traced stage times)",
                        replay_s * 1e3,
                        "ms",
                        "1F1B theory at the traced mean stage time",
                        theory_s * 1e3,
                    )
                )
                rows.append(
                    _report.Row(
                        "pipe",
                        f"{mode} m={m}: ds_pipe batch time over its replay with free p2p (transport, executor)",
                        ours_s * 1e3,
                        "ms",
                        "the replay",
                        replay_s * 1e3,
                    )
                )
    print("\nds_pipe throughput / torch.distributed.pipelining Schedule1F1B throughput (>1: ds_pipe faster)")
    for mode, m, ratio in ratios:
        print(f"  {mode:8s} m={m:<3d} {ratio:6.2f}x")
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
