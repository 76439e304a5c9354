"""ds loads checkpoints the real DeepSpeed 0.19.8 wrote and continues exactly as DeepSpeed itself did.

The checkpoints and DeepSpeed's own continuation (losses and lr of the next steps after it loaded
them) are test data made by `deepspeed_fixtures/make_fixtures.py`; DeepSpeed is not needed here.
ds runs the same job (`deepspeed_fixtures/border_job.py`) at the same world size (2 ranks), at
another one (1 rank, gradient accumulation making up the same global batch) and at another ZeRO stage.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ds_comm.testing import run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_fixtures"
DATA = FIXTURES / "data"
sys.path.insert(0, str(FIXTURES))
import border_job  # noqa: E402

MANIFEST = json.loads((DATA / "manifest.json").read_text())
CASES = sorted(c for c, v in MANIFEST["cases"].items() if v["status"] == "ok")
TOL = 1e-6


def _continue(rank: int, world_size: int, case: str, ckpt: str, stage: int | None) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size, stage)
    path, client = engine.load_checkpoint(ckpt)
    assert path is not None
    loaded_steps = engine.global_steps
    after = border_job.train(engine, engine.global_steps, border_job.STEPS_AFTER, rank, world_size,
                             border_job.dtype_of(case))
    return {"after": after, "global_steps": loaded_steps,
            "client_state": {k: client.get(k) for k in border_job.CLIENT_STATE}}


def _reference(case: str) -> dict:
    return json.loads((DATA / case / "continuation.json").read_text())


def _check(got: dict, ref: dict) -> None:
    assert got["global_steps"] == ref["global_steps"]
    assert got["client_state"] == ref["client_state"] == border_job.CLIENT_STATE
    assert [s["step"] for s in got["after"]] == [s["step"] for s in ref["after"]]
    for mine, theirs in zip(got["after"], ref["after"], strict=True):
        assert mine["lr"] == pytest.approx(theirs["lr"], abs=TOL), (mine, theirs)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)


def test_fixtures_are_small_and_from_the_pinned_deepspeed():
    total = sum(p.stat().st_size for p in DATA.rglob("*") if p.is_file())
    assert total < 4 * 2**20, f"fixture data is {total} bytes; keep the models tiny"
    assert MANIFEST["deepspeed"] == "deepspeed==0.19.8"
    assert {f"z{s}_{d}" for s in range(4) for d in ("fp32", "bf16")} <= set(CASES)
    assert not list(DATA.rglob("zero_to_fp32.py")), "DeepSpeed's own scripts must not be stored"


@pytest.mark.parametrize("case", CASES)
def test_same_world_size_continues_like_deepspeed(case):
    got = run_ranks(2, _continue, case, str(DATA / case / "ckpt"), None, timeout_s=240)
    _check(got[0], _reference(case))


@pytest.mark.parametrize("case", CASES)
def test_other_world_size_continues_like_deepspeed(case):
    got = run_ranks(1, _continue, case, str(DATA / case / "ckpt"), None, timeout_s=240)
    _check(got[0], _reference(case))


@pytest.mark.parametrize(("case", "stage", "world"), [("z2_fp32", 3, 2), ("z3_fp32", 1, 1), ("z1_bf16", 3, 1),
                                                      ("z3_bf16", 2, 2)])
def test_other_stage_continues_like_deepspeed(case, stage, world):
    got = run_ranks(world, _continue, case, str(DATA / case / "ckpt"), stage, timeout_s=240)
    _check(got[0], _reference(case))
