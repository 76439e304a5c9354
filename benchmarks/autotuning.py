"""Autotuning vs an exhaustive manual grid: the demo's GPT (examples/train_gpt.py) at 2 CPU ranks.

1. `deepspeed --autotuning tune --num_gpus N examples/train_gpt.py --deepspeed_config cfg.json` over ZeRO
   stages x micro-batch sizes (`--stages`, `--mbs`; the samples per rank per step fixed at the largest size,
   as the autotuner does), timed from start to exit: the tuning time.
2. The manual grid: every one of those configs trained by hand as an ordinary job
   (`deepspeed --num_gpus N examples/train_gpt.py --steps S`), its throughput read from the demo's own
   progress lines: samples between the step-1 and step-S lines over the time between them (the demo prints
   the running mean rate since start; the two lines give the rate of the steps in between).
   The grid is measured `--manual-rounds` times (each round in the reverse order of the one before), and
   each config's throughput is its median over the rounds: on a shared host one run can be far off.
3. The figure: the manual throughput of the config the autotuner chose over the best manual throughput
   (1.0: it chose the best; the target is >= 0.95). The grid's medians tell configs within a few percent
   of each other apart poorly (one short run on this host can be 10-20% off), so when the tuned config is
   not the grid's best the two are also run back to back `--paired-rounds` times (order alternating) and
   the target is read from the median of the per-round ratios (a *paired* figure); the grid's ratio is
   reported beside it.

    python benchmarks/autotuning.py [--nproc 2] [--stages 0,1,2] [--mbs 4,8,16] [--tuner gridsearch] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _report

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
BASE = json.loads((ROOT / "examples" / "ds_config_zero1.json").read_text())
LINE = re.compile(r"step\s+(\d+) \| loss \S+ \| lr \S+ \| ([\d.]+) samples/s")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def _launch(
    flags: list[str], cfg: Path, cwd: Path, *script_args: str
) -> tuple[subprocess.CompletedProcess[str], float]:
    cmd = [sys.executable, "-m", "ds_launcher", *flags, "--master_port", str(_port()), str(SCRIPT)]
    cmd += ["--deepspeed_config", str(cfg), "--save_dir", str(cwd / "ckpt"), *script_args]
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=3600)
    return proc, time.perf_counter() - started


def _config(stage: int, mbs: int, per_rank: int, nproc: int) -> dict:
    gas = max(per_rank // mbs, 1)
    return {
        **BASE,
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "train_batch_size": mbs * gas * nproc,
    }


def manual_throughput(stage: int, mbs: int, per_rank: int, args: argparse.Namespace, work: Path) -> float:
    """Samples/s of steps 2..S of an ordinary training job with this config (from the demo's progress lines)."""
    run = work / f"manual_z{stage}_mbs{mbs}"
    run.mkdir(parents=True)
    cfg = run / "cfg.json"
    config = _config(stage, mbs, per_rank, args.nproc)
    cfg.write_text(json.dumps(config))
    proc, _ = _launch(["--num_gpus", str(args.nproc)], cfg, run, "--steps", str(args.manual_steps))
    if proc.returncode != 0:
        raise RuntimeError(f"manual run z{stage} mbs {mbs} failed:\n{proc.stderr[-3000:]}")
    rates = {int(m.group(1)): float(m.group(2)) for m in LINE.finditer(proc.stdout)}
    first, last = 1, args.manual_steps
    batch = config["train_batch_size"]
    t_first, t_last = first * batch / rates[first], last * batch / rates[last]
    return (last - first) * batch / (t_last - t_first)


def paired_ratio(
    tuned: tuple[int, int], best: tuple[int, int], per_rank: int, args: argparse.Namespace, work: Path
) -> tuple[float, float, float]:
    """(median tuned rate, median best rate, median of the per-round tuned/best ratios) over `--paired-rounds`
    rounds, each running the two configs back to back, the order alternating."""
    rates: dict[tuple[int, int], list[float]] = {tuned: [], best: []}
    ratios = []
    for round_ in range(args.paired_rounds):
        for stage, mbs in (tuned, best) if round_ % 2 == 0 else (best, tuned):
            rate = manual_throughput(stage, mbs, per_rank, args, work / f"paired{round_}")
            rates[(stage, mbs)].append(rate)
            print(f"  paired round {round_} z{stage} mbs {mbs:<3} {rate:8.1f} samples/s", flush=True)
        ratios.append(rates[tuned][-1] / rates[best][-1])
    return statistics.median(rates[tuned]), statistics.median(rates[best]), statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--stages", default="0,1,2")
    parser.add_argument("--mbs", default="4,8,16")
    parser.add_argument("--tuner", default="gridsearch", choices=("gridsearch", "random", "model_based"))
    parser.add_argument("--manual-steps", type=int, default=10, help="optimizer steps of each manual run")
    parser.add_argument("--manual-rounds", type=int, default=3, help="passes over the manual grid")
    parser.add_argument("--profile-steps", default="2,6", help="the experiments' start_profile_step,end_profile_step")
    parser.add_argument(
        "--paired-rounds",
        type=int,
        default=5,
        help="back-to-back runs of the tuned and the best config (if they differ)",
    )
    _report.add_json_argument(parser)
    args = parser.parse_args()
    stages = [int(s) for s in args.stages.split(",")]
    sizes = [int(m) for m in args.mbs.split(",")]
    per_rank = max(sizes)
    with tempfile.TemporaryDirectory(prefix="ds_autotuning_bench_") as tmp:
        work = Path(tmp)
        cfg = work / "cfg.json"
        start, end = (int(v) for v in args.profile_steps.split(","))
        autotuning = {"enabled": True, "start_profile_step": start, "end_profile_step": end, "tuner_type": args.tuner}
        cfg.write_text(
            json.dumps(
                {
                    **BASE,
                    "zero_optimization": {"stage": stages},
                    "train_micro_batch_size_per_gpu": sizes,
                    "gradient_accumulation_steps": 1,
                    "autotuning": autotuning,
                }
            )
        )
        proc, tuning_s = _launch(["--autotuning", "tune", "--num_gpus", str(args.nproc)], cfg, work)
        if proc.returncode != 0:
            raise SystemExit(f"autotuning failed:\n{proc.stderr[-4000:]}")
        optimal = json.loads((work / "autotuning_results" / "ds_config_optimal.json").read_text())
        trials = json.loads((work / "autotuning_results" / "trials.json").read_text())
        chosen = (optimal["zero_optimization"]["stage"], optimal["train_micro_batch_size_per_gpu"])
        summary = f"{len(trials)} experiments in {tuning_s:.1f} s; chose z{chosen[0]} mbs {chosen[1]}"
        print(f"autotuning ({args.tuner}): {summary}")
        for t in trials:
            # the experiments' own metric: the median step of the profiled window
            print(f"  {t['name']:<20} {t['status']:<8} throughput {t['throughput'] or 0:8.1f} samples/s (profiled)")
        started = time.perf_counter()
        grid = [(stage, mbs) for stage in stages for mbs in sizes]
        runs: dict[tuple[int, int], list[float]] = {key: [] for key in grid}
        for round_ in range(args.manual_rounds):
            for stage, mbs in grid if round_ % 2 == 0 else reversed(grid):
                rate = manual_throughput(stage, mbs, per_rank, args, work / f"round{round_}")
                runs[(stage, mbs)].append(rate)
                print(f"  manual round {round_} z{stage} mbs {mbs:<3} {rate:8.1f} samples/s", flush=True)
        manual = {key: statistics.median(rates) for key, rates in runs.items()}
        manual_s = time.perf_counter() - started
        best = max(manual, key=manual.__getitem__)
        paired = paired_ratio(chosen, best, per_rank, args, work) if chosen != best and args.paired_rounds else None
    ratio = manual[chosen] / manual[best]
    grid_text = f"{len(manual)} configs x {args.manual_rounds} rounds in {manual_s:.1f} s (medians)"
    best_text = f"best z{best[0]} mbs {best[1]} {manual[best]:.1f} samples/s"
    tuned_text = f"the tuned config z{chosen[0]} mbs {chosen[1]} gets {manual[chosen]:.1f} samples/s"
    print(f"manual grid: {grid_text}; {best_text}; {tuned_text} = {ratio:.3f} of the best")
    space = f"{args.nproc} ranks, stages {args.stages} x micro-batch {args.mbs}, {args.tuner}"
    rows = [
        _report.Row(
            "autotuning",
            f"manual throughput of the tuned config (z{chosen[0]} mbs {chosen[1]}) / best of the manual grid "
            f"(z{best[0]} mbs {best[1]}), grid medians; {space}",
            manual[chosen],
            "samples/s",
            "best config of an exhaustive manual grid",
            manual[best],
            target="" if paired else ">= 0.95",
        )
    ]
    if paired:
        (tuned_rate, best_rate, median_ratio), rounds = paired, args.paired_rounds
        print(
            f"paired: the tuned config over the grid's best, median of {rounds} back-to-back rounds: {median_ratio:.3f}"
        )
        rows.append(
            _report.Row(
                "autotuning",
                f"tuned config (z{chosen[0]} mbs {chosen[1]}) / the grid's best (z{best[0]} mbs {best[1]}), paired "
                f"median of {rounds} back-to-back rounds; {space}",
                tuned_rate,
                "samples/s",
                "best config of an exhaustive manual grid",
                best_rate,
                ratio=median_ratio,
                target=">= 0.95",
            )
        )
    _report.write_rows(
        args.json,
        [
            *rows,
            _report.Row("autotuning", f"tuning time ({len(trials)} experiments); {space}", tuning_s, "s"),
            _report.Row(
                "autotuning",
                f"manual grid time ({len(manual)} configs x {args.manual_rounds} training runs); {space}",
                manual_s,
                "s",
            ),
        ],
    )


if __name__ == "__main__":
    main()
