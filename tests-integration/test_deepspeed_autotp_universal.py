"""Universal checkpoints of tensor-parallel (AutoTP) saves across the border, against DeepSpeed 0.19.8's own.

The fixture (`deepspeed_fixtures/make_fixtures.py`, `autotp_job.py`): DeepSpeed trains a small model at
`tensor_parallel.autotp_size: 2` on 2 ranks under ZeRO 1 and saves (`ckpt/`: one set of files per
tensor-parallel rank, each with DeepSpeed's `universal_checkpoint_info`, affine maps included), converts it
with its own `ds_to_universal` (`universal/`), and records its continuations from that universal checkpoint
at TP=1 (1 rank) and TP=2 (2 ranks). DeepSpeed is not needed here.

* ds's converter on DeepSpeed's checkpoint writes DeepSpeed's universal checkpoint, file for file, key for
  key, value for value.
* ds loads DeepSpeed's universal checkpoint at TP=1, TP=2 and TP=1 x DP=2 and continues as DeepSpeed did.
* ds trains the same job at TP=2 and saves; ds's converter makes a universal checkpoint whose tensors are
  DeepSpeed's (its files carry the category keys, `cat_dim`, where DeepSpeed's affine-map conversion
  writes the parameter alone), and ds continues from it at TP=1 as DeepSpeed continued from its own.

Losses within 1e-6: both engines run the same float operations in the same order for this model (the
reductions are over at most two ranks), so the small slack only absorbs a different summation order.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ds_comm.testing import run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_fixtures"
DATA = FIXTURES / "data"
sys.path.insert(0, str(FIXTURES))
import autotp_job  # noqa: E402
from test_deepspeed_universal import _compare_trees  # noqa: E402

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel")
MANIFEST = json.loads((DATA / "manifest.json").read_text())
CASES = sorted(c for c, v in MANIFEST.get("autotp", {}).items() if v["status"] == "ok")
TAG = f"global_step{autotp_job.STEPS_BEFORE}"
TOL = 1e-6


def _reference(case: str, tp: int) -> dict:
    return json.loads((DATA / case / "universal" / f"continuation_tp{tp}_world{tp}.json").read_text())


def _check(got: dict, ref: dict) -> None:
    assert got["global_steps"] == ref["global_steps"] == autotp_job.STEPS_BEFORE
    assert got["client_state"] == ref["client_state"] == autotp_job.CLIENT_STATE
    for mine, theirs in zip(got["after"], ref["after"], strict=True):
        assert mine["step"] == theirs["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"], abs=TOL), (mine, theirs)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)


def test_fixture_holds_deepspeeds_autotp_checkpoint_and_conversion() -> None:
    import ds_comm

    assert CASES == ["autotp_z1_fp32"], MANIFEST.get("autotp")
    ckpt = DATA / CASES[0] / "ckpt" / TAG
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_0_mp_rank_01_optim_states.pt",
    ]
    states = ds_comm.load_checkpoint_file(ckpt / "mp_rank_00_model_states.pt")
    info = states["universal_checkpoint_info"]
    assert info["parameter_with_row_parallelism_patterns"] == [r"^layers\.0\.o_proj\.weight$"]
    assert r"^layers\.0\.q_proj\.weight$" in info["affine_map"]["params"]
    assert states["module"]["layers.0.q_proj.weight"].shape == (8, 8)  # DeepSpeed saves each rank's shards
    for tp in (1, 2):
        assert _reference(CASES[0], tp)["version"] == "0.19.8"


@pytest.mark.parametrize("case", CASES)
def test_converter_writes_what_deepspeeds_writes(case: str, tmp_path: Path) -> None:
    from ds_zero import convert_to_universal

    out = convert_to_universal(DATA / case / "ckpt" / TAG, tmp_path / f"{TAG}_universal")
    diffs = _compare_trees(out, DATA / case / "universal" / f"{TAG}_universal")
    assert not diffs, diffs[:5]


def _continue(rank: int, world: int, case: str, tp: int, load_dir: str) -> dict:
    import ds_engine

    engine = autotp_job.build(ds_engine, case, tp, world, universal=True)
    path, client = engine.load_checkpoint(load_dir)
    assert path is not None
    return {
        "global_steps": engine.global_steps,
        "client_state": {k: client.get(k) for k in autotp_job.CLIENT_STATE},
        "after": autotp_job.train(engine, engine.global_steps, autotp_job.STEPS_AFTER, rank, tp, world),
    }


@pytest.mark.parametrize(("tp", "world"), [(1, 1), (2, 2), (1, 2)])
@pytest.mark.parametrize("case", CASES)
def test_ds_continues_from_deepspeeds_universal_checkpoint_like_deepspeed(case: str, tp: int, world: int) -> None:
    got = run_ranks(world, _continue, case, tp, str(DATA / case / "universal"), timeout_s=240)
    _check(got[0], _reference(case, tp))


def _train_and_save(rank: int, world: int, case: str, save_dir: str) -> dict:
    import ds_engine

    engine = autotp_job.build(ds_engine, case, 2, world)
    autotp_job.train(engine, 0, autotp_job.STEPS_BEFORE, rank, 2, world)
    engine.save_checkpoint(save_dir, client_state=dict(autotp_job.CLIENT_STATE))
    return {}


@pytest.mark.parametrize("case", CASES)
def test_ds_autotp_checkpoint_converts_to_deepspeeds_tensors_and_continues_like_deepspeed(
    case: str, tmp_path: Path
) -> None:
    import ds_comm
    from ds_zero import convert_to_universal

    save_dir = tmp_path / "ckpt"
    run_ranks(2, _train_and_save, case, str(save_dir), timeout_s=240)
    out = convert_to_universal(save_dir / TAG, save_dir / f"{TAG}_universal")
    theirs = DATA / case / "universal" / f"{TAG}_universal" / "zero"
    for path in sorted(theirs.rglob("*.pt")):
        if path.name == "optimizer_state.pt":
            continue
        mine = ds_comm.load_checkpoint_file(out / "zero" / path.relative_to(theirs))
        ref = ds_comm.load_checkpoint_file(path)
        if isinstance(ref, dict):
            torch.testing.assert_close(mine["param"], ref["param"], rtol=0, atol=TOL, msg=str(path))
        else:  # step.pt
            assert mine == ref, path
    got = run_ranks(1, _continue, case, 1, str(save_dir), timeout_s=240)
    _check(got[0], _reference(case, 1))
