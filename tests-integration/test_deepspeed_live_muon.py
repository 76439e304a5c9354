"""`"type": "Muon"` in ds against the real DeepSpeed 0.19.8 (the `deepspeed_live` nox session; skipped elsewhere).

The same 2-rank job (`deepspeed_fixtures/muon_job.py`) runs under ds and under DeepSpeed (the venv
named by `DS_REFERENCE_PYTHON`) at ZeRO stages 0, 2 and 3 (and 3 with `per_head_muon` on a model with q/k
projections and a head-count config): the param groups (names, Muon or Adam, lr,
weight decay), the `use_muon` tags and head counts, the losses and the final weights must agree (1e-6; DeepSpeed runs
its default "gram" Newton–Schulz in fp32 on a CPU, ds the same polynomial in fp32).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, free_port

JOB = Path(__file__).resolve().parent / "deepspeed_fixtures" / "muon_job.py"
REFERENCE = os.environ.get("DS_REFERENCE_PYTHON")
pytestmark = pytest.mark.skipif(not REFERENCE, reason="DS_REFERENCE_PYTHON (a venv with deepspeed==0.19.8) not set")
TOL = 1e-6


def _run(python: str, engine: str, stage: int, out: Path, per_head: bool = False) -> dict:
    cmd = [python, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}"]
    cmd += [str(JOB), "--engine", engine, "--stage", str(stage), "--out", str(out)]
    cmd += ["--per-head"] if per_head else []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1200, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "muon.json").read_text())


@pytest.mark.parametrize("stage, per_head", [(0, False), (2, False), (3, False), (3, True)])
def test_muon_matches_deepspeed(stage: int, per_head: bool, tmp_path: Path) -> None:
    assert REFERENCE is not None
    mine = _run(sys.executable, "ds", stage, tmp_path / "ds", per_head)
    theirs = _run(REFERENCE, "deepspeed", stage, tmp_path / "deepspeed", per_head)
    assert mine["groups"] == theirs["groups"]
    assert mine["tags"] == theirs["tags"]
    assert mine["heads"] == theirs["heads"]
    assert mine["losses"] == pytest.approx(theirs["losses"], abs=TOL)
    diff = max(abs(a - b) for a, b in zip(mine["weights"], theirs["weights"], strict=True))
    assert diff <= TOL, f"stage {stage} (per_head={per_head}): weights differ from DeepSpeed's by {diff}"
