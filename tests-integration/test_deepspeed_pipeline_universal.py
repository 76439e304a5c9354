"""Universal checkpoints of pipelines: ds's `ds_to_universal` writes what DeepSpeed 0.19.8's writes from a
ZeRO-1 pipeline checkpoint (layer files, one model-states file and one set of optimizer partitions per
stage), and ds's PipelineEngine loads a universal checkpoint at another stage count and data-parallel
degree, continuing as DeepSpeed did.

The fixture `pipe4_z1_fp32` (`deepspeed_fixtures/make_fixtures.py`) is a 4-layer `PipelineModule` trained
by DeepSpeed at 2 stages x 2 data-parallel ranks; `universal/` holds DeepSpeed's conversion of its
checkpoint and DeepSpeed's continuation after loading that at 1 stage x 2 ranks. DeepSpeed's converter
cannot convert the 3-layer pipeline (`pipe_z1_fp32`: it wants a layer per stage between the first and
the last layer file); ds's converts it, and the continuation from it is DeepSpeed's continuation from
the ZeRO checkpoint itself. DeepSpeed is not needed here.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from test_deepspeed_universal import _compare_trees

from ds_comm.testing import run_ranks

FIXTURES = Path(__file__).resolve().parent / "deepspeed_fixtures"
DATA = FIXTURES / "data"
sys.path.insert(0, str(FIXTURES))
import border_job  # noqa: E402

MANIFEST = json.loads((DATA / "manifest.json").read_text())
CASE = "pipe4_z1_fp32"
TAG = "global_step3"
TOL = 1e-6


def _reference(path: Path) -> dict:
    return json.loads(path.read_text())


def _check(got: dict, ref: dict) -> None:
    assert got["global_steps"] == ref["global_steps"]
    assert got["client_state"] == ref["client_state"] == border_job.CLIENT_STATE
    assert [s["step"] for s in got["after"]] == [s["step"] for s in ref["after"]]
    for mine, theirs in zip(got["after"], ref["after"], strict=True):
        assert mine["lr"] == pytest.approx(theirs["lr"], abs=TOL), (mine, theirs)
        assert mine["loss"] == pytest.approx(theirs["loss"], abs=TOL), (mine, theirs)


def _continue(rank: int, world_size: int, case: str, load_dir: str, stages: int) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size, universal=True, stages=stages)
    assert type(engine).__name__ == "PipelineEngine" and engine.num_stages == stages
    path, client = engine.load_checkpoint(load_dir)
    assert path is not None
    loaded_steps = engine.global_steps
    after = border_job.train(engine, loaded_steps, border_job.STEPS_AFTER, rank, world_size, torch.float32)
    return {
        "after": after,
        "global_steps": loaded_steps,
        "client_state": {k: client.get(k) for k in border_job.CLIENT_STATE},
    }


def test_fixture_holds_deepspeeds_pipeline_universal_checkpoint():
    assert MANIFEST["cases"][CASE]["status"] == MANIFEST["universal"][CASE]["status"] == "ok"
    root = DATA / CASE / "universal"
    assert (root / "latest_universal").read_text() == f"{TAG}_universal"
    names = sorted(p.name for p in (root / f"{TAG}_universal").iterdir())
    assert names == ["mp_rank_00_model_states.pt", "mp_rank_01_model_states.pt", "zero"]
    ref = _reference(root / "continuation.json")
    assert (ref["stages"], ref["world_size"], ref["version"]) == (1, 2, "0.19.8")
    assert _reference(DATA / CASE / "continuation.json")["world_size"] == 4
    assert "ZeroDivisionError" in MANIFEST["universal"]["pipe_z1_fp32"]["error"]
    assert "optim_states" in MANIFEST["universal"]["pipe_z0_fp32"]["error"]


def test_converter_writes_what_deepspeeds_writes_for_a_pipeline(tmp_path):
    """Every file, key, dtype, shape and value: both stages' parameters, stage 0's optimizer_state.pt."""
    from ds_zero import convert_to_universal

    out = convert_to_universal(DATA / CASE / "ckpt" / TAG, tmp_path / f"{TAG}_universal", inject_missing_state=True)
    diffs = _compare_trees(out, DATA / CASE / "universal" / f"{TAG}_universal")
    assert not diffs, diffs[:5]
    assert sorted(p.name for p in (out / "zero").iterdir()) == [
        "0.bias",
        "0.weight",
        "2.bias",
        "2.weight",
        "3.bias",
        "3.weight",
        "optimizer_state.pt",
    ]


@pytest.mark.parametrize(("stages", "world"), [(1, 1), (1, 2), (2, 4)])
def test_ds_loads_deepspeeds_pipeline_universal_checkpoint_and_continues_like_deepspeed(stages, world):
    got = run_ranks(world, _continue, CASE, str(DATA / CASE / "universal"), stages, timeout_s=300)
    ref = _reference(DATA / CASE / "universal" / "continuation.json")
    for rank_result in got:  # train_batch's loss is the mean over the global batch on every rank
        _check(rank_result, ref)


def test_ds_converts_a_pipeline_deepspeeds_converter_cannot(tmp_path):
    """The 3-layer pipeline (2 stages, dp 1): converted by ds, loaded at 1 stage x 2 ranks, it continues as
    DeepSpeed continued from the ZeRO checkpoint itself."""
    from ds_zero import convert_to_universal

    case = "pipe_z1_fp32"
    convert_to_universal(DATA / case / "ckpt" / TAG, tmp_path / f"{TAG}_universal", inject_missing_state=True)
    got = run_ranks(2, _continue, case, str(tmp_path), 1, timeout_s=300)
    _check(got[0], _reference(DATA / case / "continuation.json"))


def _train_and_save(rank: int, world_size: int, case: str, save_dir: str) -> dict:
    import ds_engine
    from ds_engine.config import set_default_checkpoint_layout

    # ds's own layout, whether or not this process imported `deepspeed` (which makes DeepSpeed's the default).
    set_default_checkpoint_layout("ds")
    engine = border_job.build(ds_engine, case, world_size)
    border_job.train(engine, 0, border_job.STEPS_BEFORE, rank, world_size, torch.float32)
    engine.save_checkpoint(save_dir, client_state=dict(border_job.CLIENT_STATE))
    return {}


@pytest.fixture(scope="module")
def ds_save(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ds's own checkpoint of the fixture's job: 2 stages x 2 data-parallel ranks, ZeRO 1."""
    save_dir = tmp_path_factory.mktemp("ds_pipe4")
    run_ranks(4, _train_and_save, CASE, str(save_dir), timeout_s=300)
    return save_dir


@pytest.mark.parametrize(("stages", "world"), [(1, 2), (2, 2)])
def test_ds_pipeline_checkpoint_converts_and_continues_like_deepspeed(ds_save, stages, world, tmp_path):
    """ds's checkpoint, converted by ds (through DeepSpeed's layout), loaded at another layout: DeepSpeed's
    continuation from its own universal checkpoint of the same job."""
    from ds_zero import convert_to_universal

    out = convert_to_universal(ds_save / TAG, tmp_path / f"{TAG}_universal", inject_missing_state=True)
    theirs = DATA / CASE / "universal" / f"{TAG}_universal"
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == sorted(
        p.relative_to(theirs) for p in theirs.rglob("*")
    )
    got = run_ranks(world, _continue, CASE, str(tmp_path), stages, timeout_s=300)
    _check(got[0], _reference(DATA / CASE / "universal" / "continuation.json"))


def test_ds_pipeline_checkpoint_in_deepspeeds_layout(ds_save, tmp_path):
    """`to_deepspeed` writes every stage: DeepSpeed's file names, and per file its keys and (within 1e-6)
    values, as DeepSpeed's own save of the same job."""
    import ds_comm
    from ds_zero.to_deepspeed import convert_to_deepspeed

    out = convert_to_deepspeed(ds_save, tmp_path)
    theirs = DATA / CASE / "ckpt" / TAG
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in theirs.iterdir())
    for path in sorted(theirs.glob("*optim_states.pt")):
        want = ds_comm.load_checkpoint_file(path)["optimizer_state_dict"]
        got = ds_comm.load_checkpoint_file(out / path.name)["optimizer_state_dict"]
        assert list(got) == list(want), path.name
        for key in ("group_paddings", "partition_count", "zero_stage", "param_alignment_paddings"):
            assert got[key] == want[key], (path.name, key)
        mine = {n: (a.numel, a.start) for n, a in got["param_slice_mappings"][0].items()}
        assert mine == {n: (a.numel, a.start) for n, a in want["param_slice_mappings"][0].items()}, path.name
        torch.testing.assert_close(
            got["single_partition_of_fp32_groups"][0],
            want["single_partition_of_fp32_groups"][0].detach(),
            atol=TOL,
            rtol=0,
        )
        for key in ("exp_avg", "exp_avg_sq"):
            want_state = want["base_optimizer_state"]["state"][0][key]
            torch.testing.assert_close(got["base_optimizer_state"]["state"][0][key], want_state, atol=TOL, rtol=0)
    for stage in range(2):
        name = f"mp_rank_0{stage}_model_states.pt"
        got, want = ds_comm.load_checkpoint_file(out / name), ds_comm.load_checkpoint_file(theirs / name)
        assert got["param_shapes"] == want["param_shapes"] and got["module"] is None
        assert got["dp_world_size"] == want["dp_world_size"] == 2


def _load_bad(rank: int, world_size: int, case: str, load_dir: str, stages: int, stage: int | None) -> dict:
    import ds_engine

    torch.manual_seed(0)
    model = border_job.pipe_model(ds_engine, case, stages)
    cfg = border_job.config(case, world_size, stage, universal=True, stages=stages)
    engine, _, _, _ = ds_engine.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    try:
        engine.load_checkpoint(load_dir)
    except Exception as err:  # noqa: BLE001  # the test asserts on type and message
        error = f"{type(err).__name__}: {err}"
    else:
        error = None
    unchanged = all(torch.equal(before[k], v) for k, v in engine.module.state_dict().items())
    return {"error": error, "unchanged": unchanged, "steps": engine.global_steps}


def test_missing_parameter_file_names_it_and_loads_nothing(tmp_path):
    shutil.copytree(DATA / CASE / "universal", tmp_path / "u")
    victim = tmp_path / "u" / f"{TAG}_universal" / "zero" / "3.weight" / "fp32.pt"
    victim.unlink()
    got = run_ranks(1, _load_bad, CASE, str(tmp_path / "u"), 1, None, timeout_s=240)[0]
    assert got["error"].startswith("FileNotFoundError") and str(victim) in got["error"], got
    assert got["unchanged"] and got["steps"] == 0


def test_a_pipeline_without_zero_cannot_load_a_universal_checkpoint():
    got = run_ranks(1, _load_bad, CASE, str(DATA / CASE / "universal"), 1, 0, timeout_s=240)[0]
    assert got["error"].startswith("ValueError") and "needs ZeRO stage 1 for a PipelineEngine" in got["error"], got
    assert got["unchanged"] and got["steps"] == 0


def test_stage_0_pipeline_and_tensor_parallel_checkpoints_are_refused_by_name(tmp_path):
    from ds_zero import convert_to_universal

    with pytest.raises(FileNotFoundError, match="stage-0"):
        convert_to_universal(DATA / "pipe_z0_fp32" / "ckpt" / TAG, tmp_path / "u0", inject_missing_state=True)
    # Two mp_rank files without layer files, recorded as tensor-parallel (pp 1, tp 2): tensor-parallel ranks,
    # which convert only with the record of how each parameter is cut (universal_checkpoint_info), which this
    # one lacks. (With its recorded pp_degree of 2 it would still convert as the pipeline it is.)
    shutil.copytree(DATA / CASE / "ckpt" / TAG, tmp_path / "tp")
    for layer in (tmp_path / "tp").glob("layer_*"):
        layer.unlink()
    for states in (tmp_path / "tp").glob("mp_rank_*_model_states.pt"):
        saved = torch.load(states, weights_only=False)
        saved["checkpoint_parallel_dimensions"] = {"pp_degree": 1, "tp_degree": 2}
        torch.save(saved, states)
    with pytest.raises(ValueError, match="tensor-parallel rank 0 of 2 but has no 'universal_checkpoint_info'"):
        convert_to_universal(tmp_path / "tp", tmp_path / "u1", inject_missing_state=True)
