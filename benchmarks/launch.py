"""Launch overhead: `deepspeed --num_gpus 2 noop.py` vs `torchrun --nproc_per_node 2 noop.py`.

Times each command from start until it exits, which is after both ranks finished. Two workloads:
`noop` (the ranks do nothing: pure launcher cost) and `noop+torch` (each rank imports torch, creates
a gloo group and runs a barrier: what a real job pays before its first step). Each cell is the median
of `--repeats` runs; the ratio is deepspeed's time over torchrun's (below 1: deepspeed is faster).

    python benchmarks/launch.py [--repeats 5] [--nproc 2]
"""

from __future__ import annotations

import argparse
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

NOOP = """\
import os
print(f"done rank {os.environ['RANK']}", flush=True)
"""

NOOP_TORCH = """\
import os
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
dist.destroy_process_group()
print(f"done rank {os.environ['RANK']}", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.setdefault("DS_ACCELERATOR", "cpu")
    return env


def _commands(script: Path, nproc: int) -> dict[str, list[str]]:
    return {
        "deepspeed": [sys.executable, "-m", "ds_launcher", "-q", "--num_gpus", str(nproc),
                      "--master_port", str(_free_port()), str(script)],
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                     str(script)],
    }


def _time_once(argv: list[str], nproc: int, cwd: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    done = re.findall(r"done rank \d+", proc.stdout)  # two ranks' lines may interleave in the pipe
    if proc.returncode != 0 or len(done) != nproc:
        raise RuntimeError(f"{argv} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    _report.add_json_argument(p)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload, text in (("noop", NOOP), ("noop+torch", NOOP_TORCH)):
            script = Path(tmp) / f"{workload.replace('+', '_')}.py"
            script.write_text(text)
            times: dict[str, list[float]] = {"deepspeed": [], "torchrun": []}
            _time_once(_commands(script, args.nproc)["deepspeed"], args.nproc, tmp)  # warm the page cache
            for _ in range(args.repeats):  # interleaved, so load changes hit both launchers alike
                for name, argv in _commands(script, args.nproc).items():
                    times[name].append(_time_once(argv, args.nproc, tmp))
            ds, tr = statistics.median(times["deepspeed"]), statistics.median(times["torchrun"])
            rows.append((workload, ds, min(times["deepspeed"]), tr, min(times["torchrun"]), ds / tr))
    print(f"launch of {args.nproc} CPU ranks, median of {args.repeats} (seconds until both ranks are done)")
    print(f"{'workload':<12} {'deepspeed':>10} {'(min)':>8} {'torchrun':>10} {'(min)':>8} {'ratio ds/torchrun':>18}")
    for workload, ds, ds_min, tr, tr_min, ratio in rows:
        print(f"{workload:<12} {ds:>10.2f} {ds_min:>8.2f} {tr:>10.2f} {tr_min:>8.2f} {ratio:>18.2f}")
    _report.write_rows(args.json, [
        _report.Row("launch", f"{workload}: {args.nproc} CPU ranks start to done, median of {args.repeats}", ds, "s",
                    f"torchrun --nproc_per_node {args.nproc}", tr) for workload, ds, _, tr, _, _ in rows])


if __name__ == "__main__":
    main()
