"""DeepSpeed 0.19.8's pipeline-parallel checkpoints (`layer_XX-model_states.pt` plus one `mp_rank_XX` file per
stage) load into ds's PipelineEngine (ds-pipe through ds-engine), which continues as DeepSpeed did; and ds's
own pipeline checkpoint of the same job has DeepSpeed's files, keys and dtypes.

The fixtures (`deepspeed_fixtures/make_fixtures.py`, cases `pipe_z0_fp32` and `pipe_z1_fp32`) are a
2-stage `PipelineModule` (data-parallel degree 1) at 2 ranks, trained with `train_batch`, ZeRO 0 and 1;
`pipe4_z1_fp32` is a 4-layer one at 2 stages x 2 data-parallel ranks. Universal checkpoints of pipelines:
`test_deepspeed_pipeline_universal.py`.
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
import border_job  # noqa: E402

MANIFEST = json.loads((DATA / "manifest.json").read_text())
CASES = sorted(c for c, v in MANIFEST["cases"].items() if v["status"] == "ok" and border_job.CASES[c].get("pipe"))
TOL = 1e-6
WORLD = border_job.PIPE_STAGES


def _reference(case: str) -> dict:
    return json.loads((DATA / case / "continuation.json").read_text())


def _world(case: str) -> int:
    return border_job.CASES[case].get("world", WORLD)


def _continue(rank: int, world_size: int, case: str, ckpt: str) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size)
    assert type(engine).__name__ == "PipelineEngine"
    path, client = engine.load_checkpoint(ckpt)
    assert path is not None
    loaded_steps = engine.global_steps
    after = border_job.train(engine, loaded_steps, border_job.STEPS_AFTER, rank, world_size, torch.float32)
    return {
        "after": after,
        "global_steps": loaded_steps,
        "client_state": {k: client.get(k) for k in border_job.CLIENT_STATE},
    }


def test_fixtures_hold_deepspeeds_pipeline_checkpoints():
    assert set(CASES) == {"pipe_z0_fp32", "pipe_z1_fp32", "pipe4_z1_fp32"}
    for case in CASES:
        tag = DATA / case / "ckpt" / "global_step3"
        names = sorted(p.name for p in tag.iterdir())
        layers = border_job.CASES[case].get("layers", 3)
        assert [n for n in names if n.startswith("layer_")] == [f"layer_0{i}-model_states.pt" for i in range(layers)]
        assert "mp_rank_00_model_states.pt" in names and "mp_rank_01_model_states.pt" in names
        if border_job.CASES[case]["stage"] == 1:
            dp = _world(case) // WORLD
            assert f"zero_pp_rank_{dp - 1}_mp_rank_01_optim_states.pt" in names


@pytest.mark.parametrize("case", CASES)
def test_ds_continues_from_deepspeeds_pipeline_checkpoint(case):
    got = run_ranks(_world(case), _continue, case, str(DATA / case / "ckpt"), timeout_s=240)
    ref = _reference(case)
    assert got[0]["global_steps"] == ref["global_steps"]
    assert got[0]["client_state"] == ref["client_state"] == border_job.CLIENT_STATE
    for mine, theirs in zip(got[0]["after"], ref["after"], strict=True):
        assert mine["step"] == theirs["step"]
        assert mine["lr"] == pytest.approx(theirs["lr"], abs=TOL), (mine, theirs)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)
    assert got[1]["after"] == got[0]["after"]  # train_batch's loss is the same on both stages


def _train_and_save(rank: int, world_size: int, case: str, save_dir: str) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size)
    border_job.train(engine, 0, border_job.STEPS_BEFORE, rank, world_size, torch.float32)
    engine.save_checkpoint(save_dir, client_state=dict(border_job.CLIENT_STATE))
    return {}


def test_ds_pipeline_checkpoint_has_deepspeeds_layer_files(tmp_path):
    """Same file names; each layer file the same keys, shapes, dtypes and (within 1e-6) values as DeepSpeed's."""
    import ds_comm

    case = "pipe_z0_fp32"
    run_ranks(WORLD, _train_and_save, case, str(tmp_path), timeout_s=240)
    theirs, mine = DATA / case / "ckpt" / "global_step3", tmp_path / "global_step3"
    assert (tmp_path / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in mine.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for layer in sorted(theirs.glob("layer_*")):
        want, got = ds_comm.load_checkpoint_file(layer), ds_comm.load_checkpoint_file(mine / layer.name)
        assert list(got) == list(want), layer.name
        for key, value in want.items():
            assert got[key].dtype == value.dtype and got[key].shape == value.shape, (layer.name, key)
            assert torch.allclose(got[key], value, atol=TOL, rtol=0), (layer.name, key)
    for stage in range(WORLD):
        want = ds_comm.load_checkpoint_file(theirs / f"mp_rank_0{stage}_model_states.pt")
        got = ds_comm.load_checkpoint_file(mine / f"mp_rank_0{stage}_model_states.pt")
        assert got["module"] is None and want["module"] is None
        for key in ("global_steps", "skipped_steps", "dp_world_size", "mp_world_size", "lr_scheduler", "my_counter"):
            assert got[key] == want[key], (stage, key)
