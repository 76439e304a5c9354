"""Shared helpers for the end-to-end tests: launch a script through `deepspeed` (python -m ds_launcher)."""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

from ds_comm.testing import preload_in_ranks

# The in-process dist tests' ranks import the engine stack; their forkserver imports it once for all of them
# ([Note: preloading a suite's modules] in ds_comm).
preload_in_ranks("ds_engine._setup.initialize", "ds_engine._engine.engine", "ds_zero._stage3.optimizer", "deepspeed")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def free_port() -> int:
    """A port nobody listens on now (other jobs on this machine may hold the launcher's default 29500)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_run(count: int) -> int:
    """The first of `count` consecutive ports nobody listens on now, below the kernel's ephemeral range.

    For jobs that take `base + n` (the autotuner moves `--master_port` by the experiment's number): a base
    from `free_port()` is an ephemeral port, and its neighbours are handed to the outgoing TCP connections
    the previous experiment's ranks open (gloo), so `base + 1` was found taken (EADDRINUSE).
    """
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports in 20000-32000")


def deepspeed(
    num_gpus: int, script: Path, *args: str, timeout: float = 180, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run `deepspeed --num_gpus N script args` (the launcher as a module, so the venv's python runs it).

    `check` raises with the job's output when it does not exit 0; every launch has a timeout.
    """
    cmd = [
        sys.executable,
        "-m",
        "ds_launcher",
        "--num_gpus",
        str(num_gpus),
        "--master_port",
        str(free_port()),
        str(script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def read_json_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
