"""The round trip both ways with the real DeepSpeed 0.19.8 (the `deepspeed_live` nox session; skipped elsewhere).

`DS_REFERENCE_PYTHON` names the python of an isolated venv with the pinned DeepSpeed
(`deepspeed_fixtures/make_fixtures.py` makes it). For each case ds trains, saves and continues from
its own checkpoint; `python -m ds_zero.to_deepspeed` writes that checkpoint in DeepSpeed's layout and
the real DeepSpeed loads it and continues: its losses and lr must equal ds's within 1e-6. The other
direction (ds continuing from DeepSpeed's checkpoints) is `test_deepspeed_checkpoints.py`, run by the
session right after regenerating the fixtures.

Universal checkpoints: ds's `ds_to_universal` (as `python -m deepspeed.checkpoint.ds_to_universal`)
converts ds's checkpoint, and the real DeepSpeed loads it with `checkpoint.load_universal: true` at
another world size (1 rank; a pipeline at 1 stage on 2 ranks) and continues as ds did from its own
checkpoint.

Pipelines with ZeRO-1 (`pipe_z1_fp32`: 2 stages; `pipe4_z1_fp32`: 2 stages x 2 data-parallel ranks) go
through `to_deepspeed` too, which writes every stage's model-states and optimizer files.

`checkpoint.layout: "deepspeed"`: ds's engine writes DeepSpeed's files itself; ds continues from that
save, and the real DeepSpeed loads it as it is and continues within 1e-6 of ds, for every case.
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
import make_fixtures  # noqa: E402

REFERENCE = os.environ.get("DS_REFERENCE_PYTHON")
pytestmark = pytest.mark.skipif(not REFERENCE, reason="DS_REFERENCE_PYTHON (a venv with deepspeed==0.19.8) not set")
CASES = [f"z{s}_{d}" for s in range(4) for d in ("fp32", "bf16")]
# ZeRO-Offload, and 2-stage pipelines without ZeRO (ds writes DeepSpeed's layer files itself) and with ZeRO-1.
MORE = ["z2_fp32_offload", "z3_bf16_offload", "pipe_z0_fp32", "pipe_z1_fp32", "pipe4_z1_fp32"]
TOL = 1e-6


def _world(case: str) -> int:
    return make_fixtures.CASES[case].get("world", make_fixtures.WORLD_SIZE)


def _ds_save(case: str, out: Path, layout: str | None = None) -> dict:
    """ds trains, saves (in `checkpoint.layout` `layout`) and continues from its own checkpoint (2 ranks, or
    the case's, torch.distributed.run)."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={_world(case)}",
        f"--master_port={free_port()}",
        str(FIXTURES / "border_job.py"),
        "save",
        "--engine",
        "ds",
        "--case",
        case,
        "--out",
        str(out),
        *(["--layout", layout] if layout else []),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "continuation.json").read_text())


@pytest.mark.timeout(600)  # two jobs: ds trains and saves, DeepSpeed loads (4 ranks each for pipe4_z1_fp32)
@pytest.mark.parametrize("case", CASES + MORE)
def test_deepspeed_continues_from_a_ds_checkpoint_like_ds(case, tmp_path):
    mine = _ds_save(case, tmp_path / "ds")
    target = tmp_path / "ds" / "ckpt"
    if make_fixtures.CASES[case]["stage"] > 0:
        target = tmp_path / "for_deepspeed"
        subprocess.run(
            [sys.executable, "-m", "ds_zero.to_deepspeed", str(tmp_path / "ds" / "ckpt"), str(target)],
            check=True,
            timeout=300,
        )
    proc = make_fixtures.run_job(
        Path(REFERENCE), "load", case, tmp_path / "deepspeed", ckpt=target, world_size=_world(case)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads((tmp_path / "deepspeed" / "continuation.json").read_text())
    _assert_continues_like(theirs, mine)


def _assert_continues_like(theirs: dict, mine: dict) -> None:
    """DeepSpeed 0.19.8's continuation `theirs` has ds's steps, client state, lr and losses (within TOL)."""
    assert theirs["version"] == "0.19.8" and theirs["global_steps"] == mine["global_steps"]
    assert theirs["client_state"] == mine["client_state"]
    for a, b in zip(mine["after"], theirs["after"], strict=True):
        assert a["step"] == b["step"]
        assert b["lr"] == pytest.approx(a["lr"], abs=TOL), (a, b)
        assert b["loss"] == pytest.approx(a["loss"], abs=TOL), (a, b)


@pytest.mark.timeout(600)  # two jobs: ds trains and saves in DeepSpeed's layout, DeepSpeed loads it as it is
@pytest.mark.parametrize("case", CASES + MORE)
def test_deepspeed_continues_from_a_deepspeed_layout_save_like_ds(case, tmp_path):
    """`checkpoint.layout: "deepspeed"`: the engine's own save, no converter; ds continues from it too."""
    mine = _ds_save(case, tmp_path / "ds", layout="deepspeed")
    save_dir = tmp_path / "ds" / "ckpt"
    assert not any(p.name.startswith(".") for p in save_dir.iterdir()), "staging left behind"
    proc = make_fixtures.run_job(
        Path(REFERENCE), "load", case, tmp_path / "deepspeed", ckpt=save_dir, world_size=_world(case)
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads((tmp_path / "deepspeed" / "continuation.json").read_text())
    _assert_continues_like(theirs, mine)
    pairs = list(zip(mine["after"], theirs["after"], strict=True))
    print(  # the figures, for `pytest -s`
        f"{case}: max |loss - DeepSpeed's| {max(abs(a['loss'] - b['loss']) for a, b in pairs):.2e}, "
        f"max |lr - DeepSpeed's| {max(abs(a['lr'] - b['lr']) for a, b in pairs):.2e}"
    )


@pytest.mark.timeout(600)  # two jobs: ds trains at 2 ranks, DeepSpeed loads at 1
@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("z0")] + ["pipe4_z1_fp32"])
def test_deepspeed_continues_from_a_ds_universal_checkpoint_like_ds(case, tmp_path):
    mine = _ds_save(case, tmp_path / "ds")
    save_dir = tmp_path / "ds" / "ckpt"
    tag = (save_dir / "latest").read_text()
    convert = [
        sys.executable,
        "-m",
        "deepspeed.checkpoint.ds_to_universal",
        "--input_folder",
        str(save_dir / tag),
        "--output_folder",
        str(save_dir / f"{tag}_universal"),
        "--inject_missing_state",
    ]
    subprocess.run(convert, check=True, timeout=300, cwd=ROOT)
    out = tmp_path / "deepspeed"
    pipe = bool(make_fixtures.CASES[case].get("pipe"))
    world = make_fixtures.UNIVERSAL_PIPE_WORLD_SIZE if pipe else make_fixtures.UNIVERSAL_WORLD_SIZE
    stages = make_fixtures.UNIVERSAL_PIPE_STAGES if pipe else None
    proc = make_fixtures.run_job(
        Path(REFERENCE), "load", case, out, ckpt=save_dir, world_size=world, universal=True, stages=stages
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    theirs = json.loads((out / "continuation.json").read_text())
    assert theirs["version"] == "0.19.8" and theirs["world_size"] == world
    assert theirs["global_steps"] == mine["global_steps"] and theirs["client_state"] == mine["client_state"]
    for a, b in zip(mine["after"], theirs["after"], strict=True):
        assert a["step"] == b["step"]
        assert b["lr"] == pytest.approx(a["lr"], abs=TOL), (a, b)
        assert b["loss"] == pytest.approx(a["loss"], abs=TOL), (a, b)
