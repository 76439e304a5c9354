"""Launch overhead: `deepspeed --num_gpus 2 noop.py` vs `torchrun --nproc_per_node 2 noop.py`.

Times each command from start until it exits, which is after both ranks finished. Two workloads:
`noop` (the ranks do nothing: pure launcher cost) and `noop+torch` (each rank imports torch, creates
a gloo group and runs a barrier: what a real job pays before its first step). Each cell is the median
of `--repeats` runs; the ratio is deepspeed's time over torchrun's (below 1: deepspeed is faster).

`--multinode` (root only: it makes hosts with tests-integration/multinode/hosts.sh and removes them
after) adds the two-node start-up: 2 nodes x 2 ranks that form one gloo group through
`ds_comm.init_distributed()` and pass a barrier, launched from node0 by `deepspeed --hostfile` with
each runner (pdsh, ssh, openmpi, slurm), against torchrun's multi-node rendezvous (one
`torchrun --nnodes 2 --rdzv-backend c10d --rdzv-endpoint node0:PORT` per node, started together).

    python benchmarks/launch.py [--repeats 5] [--nproc 2] [--multinode | --multinode-only]
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


# Ranks started by mpirun or srun learn their place from MPI/SLURM, not RANK: ds_comm finds it either way.
NOOP_DS = """\
import ds_comm
ds_comm.init_distributed(verbose=False)
ds_comm.barrier()
print(f"done rank {ds_comm.get_rank()}", flush=True)
ds_comm.destroy_process_group()
"""

HOSTS_SH = Path(__file__).resolve().parents[1] / "tests-integration" / "multinode" / "hosts.sh"
MULTINODE_RUNNERS = ("pdsh", "ssh", "openmpi", "slurm")


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
        "deepspeed": [
            sys.executable,
            "-m",
            "ds_launcher",
            "-q",
            "--num_gpus",
            str(nproc),
            "--master_port",
            str(_free_port()),
            str(script),
        ],
        "torchrun": [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            str(script),
        ],
    }


def _time_once(argv: list[str], nproc: int, cwd: str) -> float:
    start = time.perf_counter()
    proc = subprocess.run(argv, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    done = re.findall(r"done rank \d+", proc.stdout)  # two ranks' lines may interleave in the pipe
    if proc.returncode != 0 or len(done) != nproc:
        raise RuntimeError(f"{argv} failed (rc={proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return seconds


def _hosts(*args: str) -> str:
    done = subprocess.run([str(HOSTS_SH), *args], capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"hosts.sh {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")
    lines = done.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def _time_two_nodes(argvs: list[list[str]], world: int, cwd: str, env: dict[str, str]) -> float:
    """Start every command at once; seconds until the last exits, after checking all ranks finished."""
    start = time.perf_counter()
    procs = [
        subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for argv in argvs
    ]
    outs = [proc.communicate(timeout=300) for proc in procs]
    seconds = time.perf_counter() - start
    done = re.findall(r"done rank \d+", "".join(out for out, _ in outs))
    if any(proc.returncode for proc in procs) or len(done) != world:
        raise RuntimeError(f"{argvs} failed: {[p.returncode for p in procs]}\n{outs}")
    return seconds


def _multinode(repeats: int, tmp: str) -> list[tuple[str, float, float, float, float]]:
    """(runner, median, min, torchrun median, torchrun min) for 2 nodes x 2 ranks over namespace hosts."""
    script = Path(tmp) / "noop_ds.py"
    script.write_text(NOOP_DS)
    hostfile = _hosts("up", "2")  # refuses when hosts are up already: they are someone else's
    try:
        env = {**_env(), "SLURM_CONF": _hosts("slurm"), "OMP_NUM_THREADS": "1"}

        def deepspeed(runner: str) -> list[list[str]]:
            return [
                [
                    str(HOSTS_SH),
                    "exec",
                    "node0",
                    sys.executable,
                    "-m",
                    "ds_launcher",
                    "-q",
                    "--hostfile",
                    hostfile,
                    "--launcher",
                    runner,
                    "--master_port",
                    str(_free_port()),
                    str(script),
                ]
            ]

        def torchrun() -> list[list[str]]:
            port, rdzv_id = _free_port(), f"bench{time.monotonic_ns()}"
            return [
                [
                    str(HOSTS_SH),
                    "exec",
                    node,
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--nnodes",
                    "2",
                    "--nproc_per_node",
                    "2",
                    "--rdzv-backend",
                    "c10d",
                    "--rdzv-endpoint",
                    f"node0:{port}",
                    "--rdzv-id",
                    rdzv_id,
                    str(script),
                ]
                for node in ("node0", "node1")
            ]

        _time_two_nodes(deepspeed("pdsh"), 4, tmp, env)  # warm the page cache
        times: dict[str, list[float]] = {name: [] for name in (*MULTINODE_RUNNERS, "torchrun")}
        for _ in range(repeats):  # interleaved, so load changes hit every launcher alike
            for runner in MULTINODE_RUNNERS:
                times[runner].append(_time_two_nodes(deepspeed(runner), 4, tmp, env))
            times["torchrun"].append(_time_two_nodes(torchrun(), 4, tmp, env))
    finally:
        _hosts("down")
    tr = times["torchrun"]
    return [
        (runner, statistics.median(times[runner]), min(times[runner]), statistics.median(tr), min(tr))
        for runner in MULTINODE_RUNNERS
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument(
        "--multinode",
        action="store_true",
        help="also time 2 nodes x 2 ranks per runner vs torchrun c10d (root; makes namespace hosts)",
    )
    p.add_argument("--multinode-only", action="store_true", help="--multinode without the one-node table")
    _report.add_json_argument(p)
    args = p.parse_args()
    args.multinode |= args.multinode_only
    if args.multinode and os.geteuid() != 0:
        p.error("--multinode needs root: it makes hosts as network namespaces (tests-integration/multinode/hosts.sh)")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workload, text in () if args.multinode_only else (("noop", NOOP), ("noop+torch", NOOP_TORCH)):
            script = Path(tmp) / f"{workload.replace('+', '_')}.py"
            script.write_text(text)
            times: dict[str, list[float]] = {"deepspeed": [], "torchrun": []}
            _time_once(_commands(script, args.nproc)["deepspeed"], args.nproc, tmp)  # warm the page cache
            for _ in range(args.repeats):  # interleaved, so load changes hit both launchers alike
                for name, argv in _commands(script, args.nproc).items():
                    times[name].append(_time_once(argv, args.nproc, tmp))
            ds, tr = statistics.median(times["deepspeed"]), statistics.median(times["torchrun"])
            rows.append((workload, ds, min(times["deepspeed"]), tr, min(times["torchrun"]), ds / tr))
        multinode = _multinode(args.repeats, tmp) if args.multinode else []
    if rows:
        print(f"launch of {args.nproc} CPU ranks, median of {args.repeats} (seconds until both ranks are done)")
        print(
            f"{'workload':<12} {'deepspeed':>10} {'(min)':>8} {'torchrun':>10} {'(min)':>8} {'ratio ds/torchrun':>18}"
        )
        for workload, ds, ds_min, tr, tr_min, ratio in rows:
            print(f"{workload:<12} {ds:>10.2f} {ds_min:>8.2f} {tr:>10.2f} {tr_min:>8.2f} {ratio:>18.2f}")
    report = [
        _report.Row(
            "launch",
            f"{workload}: {args.nproc} CPU ranks start to done, median of {args.repeats}",
            ds,
            "s",
            f"torchrun --nproc_per_node {args.nproc}",
            tr,
        )
        for workload, ds, _, tr, _, _ in rows
    ]
    if multinode:
        print(
            f"\n2 nodes x 2 CPU ranks (network namespaces), init_distributed + barrier, median of {args.repeats} "
            "(seconds until every rank is done)"
        )
        print(f"{'runner':<12} {'deepspeed':>10} {'(min)':>8} {'torchrun':>10} {'(min)':>8} {'ratio ds/torchrun':>18}")
        for runner, ds, ds_min, tr, tr_min in multinode:
            print(f"{runner:<12} {ds:>10.2f} {ds_min:>8.2f} {tr:>10.2f} {tr_min:>8.2f} {ds / tr:>18.2f}")
        report += [
            _report.Row(
                "launch",
                f"2 nodes x 2 ranks, --launcher {runner}: start to done, median of {args.repeats}",
                ds,
                "s",
                "torchrun --nnodes 2 --rdzv-backend c10d",
                tr,
            )
            for runner, ds, _, tr, _ in multinode
        ]
    _report.write_rows(args.json, report)


if __name__ == "__main__":
    main()
