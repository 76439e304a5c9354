"""Universal checkpoints across the border: ds's `ds_to_universal` writes what DeepSpeed 0.19.8's writes, and
ds loads a universal checkpoint at any world size and ZeRO stage, continuing as DeepSpeed did.

The fixtures (`deepspeed_fixtures/make_fixtures.py`) hold, per case, DeepSpeed's own conversion of its
checkpoint (`universal/<tag>_universal`, `universal/latest_universal`) and DeepSpeed's continuation after
loading it with `checkpoint.load_universal: true` at 1 rank (`universal/continuation.json`; the
checkpoint was saved at 2). DeepSpeed is not needed here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT

from ds_comm.testing import run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_fixtures"
DATA = FIXTURES / "data"
sys.path.insert(0, str(FIXTURES))
import border_job  # noqa: E402

MANIFEST = json.loads((DATA / "manifest.json").read_text())
# Pipeline cases load into a PipelineEngine: test_deepspeed_pipeline_universal.py.
CASES = sorted(
    c for c, v in MANIFEST.get("universal", {}).items() if v["status"] == "ok" and not border_job.CASES[c].get("pipe")
)
TOL = 1e-6
TAG = "global_step3"


def _reference(case: str) -> dict:
    return json.loads((DATA / case / "universal" / "continuation.json").read_text())


def _check(got: dict, ref: dict) -> None:
    assert got["global_steps"] == ref["global_steps"]
    assert got["client_state"] == ref["client_state"] == border_job.CLIENT_STATE
    assert [s["step"] for s in got["after"]] == [s["step"] for s in ref["after"]]
    for mine, theirs in zip(got["after"], ref["after"], strict=True):
        assert mine["lr"] == pytest.approx(theirs["lr"], abs=TOL), (mine, theirs)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)


def _same(a, b, path: str, diffs: list) -> None:
    """Every key, type, dtype, shape, requires_grad and value of `a` and `b` (loaded checkpoint files)."""
    if isinstance(a, dict):
        if list(a) != list(b):
            diffs.append((path, "keys", list(a), list(b)))
            return
        for k in a:
            _same(a[k], b[k], f"{path}/{k}", diffs)
    elif isinstance(a, (list, tuple)):
        if type(a) is not type(b) or len(a) != len(b):
            diffs.append((path, "sequence", a, b))
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]", diffs)
    elif isinstance(a, torch.Tensor):
        same = (
            isinstance(b, torch.Tensor)
            and (a.dtype, a.shape, a.requires_grad) == (b.dtype, b.shape, b.requires_grad)
            and torch.equal(a, b)
        )
        if not same:
            diffs.append((path, "tensor"))
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        if type(a) is not type(b) or a.__dict__ != b.__dict__:
            diffs.append((path, a, b))
    elif type(a) is not type(b) or a != b:
        diffs.append((path, a, b))


def _compare_trees(mine: Path, theirs: Path) -> list:
    import ds_comm

    files = sorted(p.relative_to(theirs) for p in theirs.rglob("*") if p.is_file())
    assert sorted(p.relative_to(mine) for p in mine.rglob("*") if p.is_file()) == files
    diffs: list = []
    for f in files:
        _same(ds_comm.load_checkpoint_file(mine / f), ds_comm.load_checkpoint_file(theirs / f), str(f), diffs)
    return diffs


def test_fixtures_hold_deepspeeds_universal_checkpoints():
    assert {f"z{s}_{d}" for s in (1, 2, 3) for d in ("fp32", "bf16")} <= set(CASES)
    assert MANIFEST["universal_world_size"] == 1
    for case in CASES:
        root = DATA / case / "universal"
        assert (root / "latest_universal").read_text() == f"{TAG}_universal"
        assert (root / f"{TAG}_universal" / "zero" / "optimizer_state.pt").is_file()
        assert _reference(case)["world_size"] == 1 and _reference(case)["version"] == "0.19.8"
    stage0 = MANIFEST["universal"]["z0_fp32"]
    assert stage0["status"] == "unsupported" and "optim_states" in stage0["error"]


@pytest.mark.parametrize("case", CASES)
def test_converter_writes_what_deepspeeds_writes(case, tmp_path):
    """Every file, key, dtype, shape and value, from DeepSpeed's checkpoint of the case."""
    from ds_zero import convert_to_universal

    out = convert_to_universal(DATA / case / "ckpt" / TAG, tmp_path / f"{TAG}_universal", inject_missing_state=True)
    assert (tmp_path / "latest_universal").read_text() == f"{TAG}_universal"
    assert not (out / "tmp").exists()
    diffs = _compare_trees(out, DATA / case / "universal" / f"{TAG}_universal")
    assert not diffs, diffs[:5]


def _cli(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=os.environ
    )


@pytest.mark.parametrize("module", ["deepspeed.checkpoint.ds_to_universal", "ds_zero.ds_to_universal"])
def test_command_line_takes_deepspeeds_arguments(module, tmp_path):
    src = DATA / "z2_bf16" / "ckpt" / TAG
    out = tmp_path / "uni"
    base = ["--input_folder", str(src), "--output_folder", str(out), "--num_extract_workers", "2"]
    refused = _cli(module, *base, "--num_merge_workers", "3", "--no_strict")
    assert refused.returncode == 2 and "--inject_missing_state" in refused.stderr and not out.exists()
    done = _cli(module, *base, "--num_merge_workers", "3", "--inject_missing_state", "--keep_temp_folder")
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "latest_universal").read_text() == "uni"
    assert not _compare_trees(out, DATA / "z2_bf16" / "universal" / f"{TAG}_universal")
    stage0 = _cli(module, "--input_folder", str(DATA / "z0_fp32" / "ckpt" / TAG), "--output_folder", str(out))
    assert stage0.returncode == 2 and "optim_states.pt" in stage0.stderr and "stage-0" in stage0.stderr


def _continue(rank: int, world_size: int, case: str, load_dir: str, stage: int | None) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size, stage, universal=True)
    assert engine.load_universal_checkpoint() is True
    path, client = engine.load_checkpoint(load_dir)
    assert path is not None
    loaded_steps = engine.global_steps
    after = border_job.train(
        engine, engine.global_steps, border_job.STEPS_AFTER, rank, world_size, border_job.dtype_of(case)
    )
    return {
        "after": after,
        "global_steps": loaded_steps,
        "client_state": {k: client.get(k) for k in border_job.CLIENT_STATE},
    }


# Known gap: from DeepSpeed's universal checkpoint of a ZeRO-3 job with tied and frozen parameters, ds's first
# step after the load is 6e-4 off DeepSpeed's (0.4384 vs 0.4378); not yet traced. Strict: a fix makes it pass.
_CONTINUATION_GAPS = {"z3_tied_frozen_fp32": "the tied/frozen ZeRO-3 universal continuation differs by 6e-4"}


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.xfail(strict=True, reason=_CONTINUATION_GAPS[c]))
        if c in _CONTINUATION_GAPS
        else c
        for c in CASES
    ],
)
def test_ds_loads_deepspeeds_universal_checkpoint_and_continues_like_deepspeed(case, world):
    got = run_ranks(world, _continue, case, str(DATA / case / "universal"), None, timeout_s=240)
    _check(got[0], _reference(case))


@pytest.mark.parametrize(
    ("case", "stage", "world"), [("z1_fp32", 3, 2), ("z3_fp32", 2, 1), ("z3_bf16", 1, 2), ("z2_bf16", 3, 1)]
)
def test_ds_loads_a_universal_checkpoint_into_another_stage(case, stage, world):
    got = run_ranks(world, _continue, case, str(DATA / case / "universal"), stage, timeout_s=240)
    _check(got[0], _reference(case))


def _train_and_save(rank: int, world_size: int, case: str, save_dir: str) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size)
    border_job.train(engine, 0, border_job.STEPS_BEFORE, rank, world_size, border_job.dtype_of(case))
    engine.save_checkpoint(save_dir, client_state=dict(border_job.CLIENT_STATE))
    return {}


@pytest.mark.parametrize(("case", "stage", "world"), [("z2_fp32", 3, 1), ("z3_bf16", 1, 1), ("z1_bf16", 2, 2)])
def test_ds_checkpoint_converts_and_continues_like_deepspeed(case, stage, world, tmp_path):
    """ds's own checkpoint (2 ranks), converted by ds, loaded at another world size and stage: DeepSpeed's
    continuation from its universal checkpoint of the same job."""
    from ds_zero import convert_to_universal

    save_dir = tmp_path / "ckpt"
    run_ranks(2, _train_and_save, case, str(save_dir), timeout_s=240)
    convert_to_universal(save_dir / TAG, save_dir / f"{TAG}_universal", inject_missing_state=True)
    got = run_ranks(world, _continue, case, str(save_dir), stage, timeout_s=240)
    _check(got[0], _reference(case))


def _load_bad(rank: int, world_size: int, case: str, load_dir: str, stage: int | None) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size, stage, universal=True)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    try:
        engine.load_checkpoint(load_dir)
    except Exception as err:  # noqa: BLE001  # the test asserts on type and message
        error = f"{type(err).__name__}: {err}"
    else:
        error = None
    unchanged = all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    return {"error": error, "unchanged": unchanged, "steps": engine.global_steps}


def test_missing_latest_universal_is_an_error(tmp_path):
    shutil.copytree(DATA / "z2_fp32" / "universal", tmp_path / "u")
    (tmp_path / "u" / "latest_universal").unlink()
    got = run_ranks(1, _load_bad, "z2_fp32", str(tmp_path / "u"), None, timeout_s=240)[0]
    assert got["error"].startswith("ValueError") and "latest_universal" in got["error"], got
    assert got["unchanged"] and got["steps"] == 0


def test_missing_parameter_file_names_it_and_loads_nothing(tmp_path):
    shutil.copytree(DATA / "z3_fp32" / "universal", tmp_path / "u")
    victim = tmp_path / "u" / f"{TAG}_universal" / "zero" / "fc2.weight" / "fp32.pt"
    victim.unlink()
    got = run_ranks(1, _load_bad, "z3_fp32", str(tmp_path / "u"), 2, timeout_s=240)[0]
    assert got["error"].startswith("FileNotFoundError") and str(victim) in got["error"], got
    assert got["unchanged"] and got["steps"] == 0


def test_stage_0_cannot_load_a_universal_checkpoint():
    got = run_ranks(1, _load_bad, "z2_fp32", str(DATA / "z2_fp32" / "universal"), 0, timeout_s=240)[0]
    assert got["error"].startswith("ValueError") and "ZeRO stage 1, 2 or 3" in got["error"], got
    assert got["unchanged"] and got["steps"] == 0
