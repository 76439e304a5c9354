"""MoE side by side with the real DeepSpeed 0.19.8 (the `deepspeed_live` nox session; skipped elsewhere).

`DS_REFERENCE_PYTHON` names the python of an isolated venv with the pinned DeepSpeed. For each case both
engines run `deepspeed_fixtures/moe_job.py` on 2 gloo ranks: the same weights by (global) name, the same
batches and RNG draws, `deepspeed.moe.layer.MoE` layers at ZeRO stages 0-2, ep_size 1 and 2, top-1 and
top-2, with and without random token selection. Every step's loss and l_aux must agree within 1e-5 and
every layer's exp_counts exactly. Clipping is only used at stages 1/2: at stage 0 DeepSpeed clips MoE
models by the mean of the ranks' local norms, ds by the global norm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, free_port

FIXTURES = Path(__file__).resolve().parent / "deepspeed_fixtures"
sys.path.insert(0, str(FIXTURES))
import moe_job  # noqa: E402

REFERENCE = os.environ.get("DS_REFERENCE_PYTHON")
pytestmark = pytest.mark.skipif(not REFERENCE, reason="DS_REFERENCE_PYTHON (a venv with deepspeed==0.19.8) not set")
TOL = 1e-5


def _run(python: str, engine: str, case: str, out: Path) -> dict:
    cmd = [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        f"--master_port={free_port()}",
        str(FIXTURES / "moe_job.py"),
        "--engine",
        engine,
        "--case",
        case,
        "--out",
        str(out),
    ]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    if engine == "deepspeed":
        env.pop("PYTHONPATH", None)  # it may point at ds's sources
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "moe.json").read_text())


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", sorted(moe_job.CASES))
def test_moe_matches_deepspeed(case: str, tmp_path: Path) -> None:
    theirs = _run(str(REFERENCE), "deepspeed", case, tmp_path / "deepspeed")
    mine = _run(sys.executable, "ds", case, tmp_path / "ds")
    assert theirs["version"] == "0.19.8"
    for rank, (a_steps, b_steps) in enumerate(zip(mine["ranks"], theirs["ranks"], strict=True)):
        for step, (a, b) in enumerate(zip(a_steps, b_steps, strict=True)):
            where = f"rank {rank} step {step}"
            assert a["exp_counts"] == b["exp_counts"], (where, a, b)
            assert a["loss"] == pytest.approx(b["loss"], abs=TOL), (where, a, b)
            assert a["l_aux"] == pytest.approx(b["l_aux"], abs=TOL), (where, a, b)
