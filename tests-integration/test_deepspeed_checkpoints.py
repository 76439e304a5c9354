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

from ds_comm.checkpoint_files import deepspeed_pickle_names as _deepspeed_names  # noqa: E402

MANIFEST = json.loads((DATA / "manifest.json").read_text())
# Pipeline cases need their stage count and their own training loop: test_deepspeed_pipeline.py.
CASES = sorted(c for c, v in MANIFEST["cases"].items() if v["status"] == "ok" and not border_job.CASES[c].get("pipe"))
TOL = 1e-6


def _continue(rank: int, world_size: int, case: str, ckpt: str, stage: int | None) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size, stage)
    path, client = engine.load_checkpoint(ckpt)
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


@pytest.mark.parametrize(
    ("case", "stage", "world"), [("z2_fp32", 3, 2), ("z3_fp32", 1, 1), ("z1_bf16", 3, 1), ("z3_bf16", 2, 2)]
)
def test_other_stage_continues_like_deepspeed(case, stage, world):
    got = run_ranks(world, _continue, case, str(DATA / case / "ckpt"), stage, timeout_s=240)
    _check(got[0], _reference(case))


def _load_bad(rank: int, world_size: int, case: str, ckpt: str) -> dict:
    """Load a damaged checkpoint; return the error and whether the engine's weights stayed as they were."""
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size)
    before = {k: v.clone() for k, v in engine.module.state_dict().items()}
    try:
        engine.load_checkpoint(ckpt)
    except Exception as err:  # noqa: BLE001  # the test asserts on type and message
        error = f"{type(err).__name__}: {err}"
    else:
        error = None
    after = engine.module.state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    return {"error": error, "unchanged": unchanged, "steps": engine.global_steps}


def _copy(case: str, tmp_path: Path) -> tuple[Path, Path]:
    dst = tmp_path / case
    shutil.copytree(DATA / case / "ckpt", dst)
    return dst, dst / (dst / "latest").read_text()


@pytest.mark.parametrize("case", ["z2_fp32", "z3_bf16"])
def test_truncated_rank_file_names_it_and_loads_nothing(case, tmp_path):
    root, tag = _copy(case, tmp_path)
    victim = sorted(tag.glob("*zero_pp_rank_1_mp_rank_00_optim_states.pt"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    got = run_ranks(1, _load_bad, case, str(root), timeout_s=240)[0]
    assert got["error"] and got["error"].startswith("CheckpointFileError"), got
    assert victim.name in got["error"] and "truncated or corrupt" in got["error"]
    assert got["unchanged"] and got["steps"] == 0


@pytest.mark.parametrize("which", ["mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"])
def test_newer_deepspeed_version_is_refused(which, tmp_path):
    import ds_comm

    root, tag = _copy("z1_fp32", tmp_path)
    victim = tag / which
    state = ds_comm.load_checkpoint_file(victim)
    state["ds_version"] = "0.99.0"
    with _deepspeed_names():
        torch.save(state, victim)
    got = run_ranks(1, _load_bad, "z1_fp32", str(root), timeout_s=240)[0]
    assert got["error"] and "0.99.0" in got["error"] and "newer" in got["error"] and which in got["error"], got
    assert got["unchanged"] and got["steps"] == 0


def _same(a, b, path: str, diffs: list) -> None:
    if isinstance(a, dict):
        if set(a) != set(b):
            diffs.append((path, "keys", sorted(map(str, set(a) ^ set(b)))))
            return
        for k in a:
            _same(a[k], b[k], f"{path}/{k}", diffs)
    elif isinstance(a, (list, tuple)):
        if len(a) != len(b):
            diffs.append((path, "length", len(a), len(b)))
            return
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{path}[{i}]", diffs)
    elif isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)):
            diffs.append((path, "tensor"))
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        if type(a) is not type(b) or a.__dict__ != b.__dict__:
            diffs.append((path, a, b))
    elif a != b:
        diffs.append((path, a, b))


def _zero_stage3_padding(state: dict, name: str, param_shapes: list) -> dict:
    """DeepSpeed leaves the tail of a stage-3 slot past a parameter's end (on the last ranks) as `torch.empty`
    gave it; ds writes zeros there. Zero it in a DeepSpeed file before comparing (the values are garbage)."""
    import math

    rank = int(name.split("zero_pp_rank_")[1].split("_")[0])
    if name.endswith("_model_states.pt"):
        for key, frag in (state.get("frozen_param_fragments") or {}).items():
            valid = math.prod(state["frozen_param_shapes"][key]) - rank * frag.numel()
            frag[max(0, valid) :] = 0
        return state
    sd = state["optimizer_state_dict"]
    world, at, pads = int(sd["partition_count"]), 0, []
    for shapes in param_shapes:
        for shape in shapes.values():
            per = -(-math.prod(shape) // world)
            pads.append((at + max(0, min(per, math.prod(shape) - rank * per)), at + per))
            at += per
    # the flat groups and each optimizer-state key's tensors (one per flat group) lie end to end per rank
    base = sd["optimizer_state_dict"]["state"]
    runs = [sd["fp32_flat_groups"]]
    keys = {k for group in base.values() for k, v in group.items() if isinstance(v, torch.Tensor) and v.dim()}
    runs += [[base[g][k] for g in sorted(base)] for k in sorted(keys)]
    for tensors in runs:
        start = 0
        for t in tensors:
            for lo, hi in pads:
                a, b = max(lo, start), min(hi, start + t.numel())
                if a < b:
                    t.data[a - start : b - start] = 0
            start += t.numel()
    return state


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("z0")])
def test_writing_deepspeed_layout_reproduces_deepspeeds_own_files(case, tmp_path):
    """DeepSpeed's checkpoint, read by ds and written back by `to_deepspeed`: every file, key, dtype and value
    (flat partitions, paddings, slice mappings, optimizer state, stage-3 placeholders, frozen fragments, tied
    names) equals DeepSpeed's."""
    import ds_comm
    from ds_zero.to_deepspeed import convert_to_deepspeed

    src = DATA / case / "ckpt"
    out = convert_to_deepspeed(src, tmp_path)
    tag = src / (src / "latest").read_text()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in tag.iterdir())
    stage3 = border_job.CASES[case]["stage"] == 3
    param_shapes = ds_comm.load_checkpoint_file(next(tag.glob("*model_states.pt")))["param_shapes"]
    diffs: list = []
    for f in sorted(tag.iterdir()):
        theirs = ds_comm.load_checkpoint_file(f)
        if stage3:
            theirs = _zero_stage3_padding(theirs, f.name, param_shapes)
        _same(theirs, ds_comm.load_checkpoint_file(out / f.name), f.name, diffs)
    assert not diffs, diffs[:5]


_NO_DS = (
    "import runpy, sys\n"
    "for name in ('ds_comm', 'ds_ops', 'ds_zero', 'ds_engine', 'ds_pipe', 'deepspeed'):\n"
    "    sys.modules[name] = None  # importing any of them now fails\n"
    "sys.argv = sys.argv[1:]\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def _run_copied_script(save_dir: Path, out: Path) -> dict:
    """`python zero_to_fp32.py . out` inside `save_dir`, with every ds package (and deepspeed) unimportable."""
    import subprocess

    script = save_dir / "zero_to_fp32.py"
    proc = subprocess.run(
        [sys.executable, "-c", _NO_DS, str(script), ".", str(out)],
        cwd=save_dir,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return torch.load(out / "pytorch_model.bin", weights_only=True)


@pytest.mark.parametrize("case", [c for c in CASES if not c.startswith("z0")])
def test_copied_zero_to_fp32_reads_deepspeed_checkpoints_with_torch_only(case, tmp_path):
    from ds_zero import copy_zero_to_fp32_script, get_fp32_state_dict_from_zero_checkpoint

    save_dir = tmp_path / "ckpt"
    shutil.copytree(DATA / case / "ckpt", save_dir)
    copy_zero_to_fp32_script(save_dir)
    got = _run_copied_script(save_dir, tmp_path / "out")
    want = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert list(got) == list(want) and "buf" in got
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name


def _train_and_save(rank: int, world_size: int, case: str, save_dir: str) -> dict:
    import ds_engine

    engine = border_job.build(ds_engine, case, world_size)
    border_job.train(engine, 0, border_job.STEPS_BEFORE, rank, world_size, border_job.dtype_of(case))
    engine.save_checkpoint(save_dir)
    return {}


@pytest.mark.parametrize("case", ["z2_fp32", "z3_bf16"])
def test_ds_checkpoint_gets_a_working_zero_to_fp32_script(case, tmp_path):
    """The engine copies the script into the save directory; it and `python -m ds_engine.utils.zero_to_fp32`
    rebuild the same fp32 weights, equal to ds-zero's consolidation."""
    import subprocess

    from ds_zero import get_fp32_state_dict_from_zero_checkpoint

    save_dir = tmp_path / "ckpt"
    run_ranks(2, _train_and_save, case, str(save_dir), timeout_s=240)
    assert (save_dir / "zero_to_fp32.py").is_file()
    got = _run_copied_script(save_dir, tmp_path / "script")
    proc = subprocess.run(
        [sys.executable, "-m", "ds_engine.utils.zero_to_fp32", "-q", str(save_dir), str(tmp_path / "module")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    by_module = torch.load(tmp_path / "module" / "pytorch_model.bin", weights_only=True)
    want = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert list(got) == list(want) == list(by_module)
    for name in want:
        assert torch.equal(got[name], want[name]) and torch.equal(by_module[name], want[name]), name
