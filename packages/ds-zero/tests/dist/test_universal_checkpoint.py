"""Universal checkpoints from ds-zero's own saves: `convert_to_universal` writes every parameter whole (equal to
`zero_to_fp32`'s consolidation, optimizer state included), and a universal checkpoint loads at 1 and 4
ranks (re-partitioned) exactly as the ZeRO checkpoint itself loads there, and (fp32) within 1e-5 of the run
that kept going at the saved size (2 ranks). Two param groups with different lrs, frozen parameters, a
buffer, fp32 and bf16."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from zero_dist_cases import Tiny, flat_params, make_model, make_optimizer, train_zero, zero_config

import ds_comm
import ds_zero
from ds_comm.testing import run_ranks

SAVE_AT, TOTAL = 4, 7
RUNS = {"s2-fp32": (2, torch.float32), "s1-bf16": (1, torch.bfloat16)}
TAG = f"global_step{SAVE_AT}"


def _build(stage: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tiny, ds_zero.DeepSpeedZeroOptimizer]:
    model = make_model(seed=seed, dtype=dtype)
    config = zero_config(stage, reduce_bucket_size=120, allgather_bucket_size=400)
    return model, ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=config, module=model, clip_grad=0.05)


def _save_then_continue(rank: int, world: int, root: str) -> dict:
    out = {}
    for name, (stage, dtype) in RUNS.items():
        model, opt = _build(stage, dtype)
        train_zero(opt, model, rank, world, range(SAVE_AT), gas=2)
        ds_zero.save_zero_checkpoint(f"{root}/{name}", TAG, opt, model, bf16_prefix=dtype == torch.bfloat16)
        exp_avg = [opt.optimizer.state[m]["exp_avg"].clone() for m in opt.masters]
        losses = train_zero(opt, model, rank, world, range(SAVE_AT, TOTAL), gas=2)
        out[name] = {"losses": losses, "params": flat_params(model), "exp_avg": exp_avg}
        opt.close()
    return out


def _load_then_continue(rank: int, world: int, root: str, universal: bool) -> dict:
    out = {}
    for name, (stage, dtype) in RUNS.items():
        model, opt = _build(stage, dtype, seed=123)  # a different init: everything must come from disk
        if universal:
            folder = Path(root) / name / f"{TAG}_universal"
            parts = ds_zero.load_universal_partitions(folder)
            full = ds_zero.consolidate_fp32_params(parts)
            saved = ds_comm.load_checkpoint_file(ds_zero.universal_model_states_file(folder))["module"]
            model.load_state_dict({k: full[k].to(v.dtype) if k in full else v for k, v in saved.items()})
            opt.load_state_dict(parts, load_optimizer_states=True, load_from_fp32_weights=True)
        else:
            ds_zero.load_zero_checkpoint(f"{root}/{name}", opt, model)
        losses = train_zero(opt, model, rank, world, range(SAVE_AT, TOTAL), gas=2)
        out[name] = {"losses": losses, "params": flat_params(model)}
        opt.close()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("on2")
    on2 = run_ranks(2, _save_then_continue, root=str(root), timeout_s=120)
    for name in RUNS:
        ds_zero.convert_to_universal(root / name / TAG, root / name / f"{TAG}_universal", inject_missing_state=True)
    return {"root": root, "on2": on2}


def test_universal_files_are_the_whole_parameters(saved: dict) -> None:
    root = saved["root"] / "s2-fp32"
    uni = root / f"{TAG}_universal"
    assert (root / "latest_universal").read_text() == f"{TAG}_universal"
    assert sorted(p.name for p in uni.iterdir()) == ["mp_rank_00_model_states.pt", "zero"]
    fp32 = ds_zero.get_fp32_state_dict_from_zero_checkpoint(root)
    module = ds_comm.load_checkpoint_file(uni / "mp_rank_00_model_states.pt")["module"]
    for name, value in fp32.items():  # parameters, frozen ones and the buffer: a full fp32 value each
        got = ds_comm.load_checkpoint_file(uni / "zero" / name / "fp32.pt")
        assert torch.equal(got["param"], value), name
        if name in ("frozen.weight", "frozen.bias", "offset"):  # no optimizer state: copied from the module
            assert list(got) == ["param"] and torch.equal(got["param"], module[name].float())
            assert not (uni / "zero" / name / "exp_avg.pt").exists()
        else:
            assert got["cat_dim"] == 0
            assert float(ds_comm.load_checkpoint_file(uni / "zero" / name / "step.pt")) == SAVE_AT
    # exp_avg of group 1 ("mid.weight" alone) is the two ranks' partitions, back to back
    exp_avg = ds_comm.load_checkpoint_file(uni / "zero" / "mid.weight" / "exp_avg.pt")["param"]
    held = torch.cat([saved["on2"][r]["s2-fp32"]["exp_avg"][1] for r in range(2)])
    assert torch.equal(held[: exp_avg.numel()], exp_avg.reshape(-1))


@pytest.mark.parametrize("world", [1, 4])
def test_universal_checkpoint_resumes_at_another_world_size(saved: dict, world: int) -> None:
    got = run_ranks(world, _load_then_continue, root=str(saved["root"]), universal=True, timeout_s=120)
    plain = run_ranks(world, _load_then_continue, root=str(saved["root"]), universal=False, timeout_s=120)
    for name in RUNS:
        assert got[0][name]["losses"] == plain[0][name]["losses"], name
        assert all(torch.equal(r[name]["params"], got[0][name]["params"]) for r in got + plain), name
    ref = saved["on2"][0]["s2-fp32"]  # bf16 reductions round differently at another world size
    err = max(abs(a - b) for a, b in zip(got[0]["s2-fp32"]["losses"], ref["losses"], strict=True))
    assert err <= 1e-5, f"at {world} ranks: losses differ by {err}"
    assert float((got[0]["s2-fp32"]["params"] - ref["params"]).abs().max()) <= 1e-5


def test_missing_universal_info_and_stage_0_are_refused(saved: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--inject_missing_state"):
        ds_zero.convert_to_universal(saved["root"] / "s2-fp32" / TAG, tmp_path / "u")
    assert not (tmp_path / "latest_universal").exists()
    (tmp_path / "stage0").mkdir()
    torch.save({"module": {}}, tmp_path / "stage0" / "mp_rank_00_model_states.pt")
    with pytest.raises(FileNotFoundError, match="stage-0"):
        ds_zero.convert_to_universal(tmp_path / "stage0", tmp_path / "u0", inject_missing_state=True)


def test_a_rank_reads_only_what_it_holds(saved: dict) -> None:
    """`param_shapes=` picks the parameters the loading model holds (a pipeline stage's) and `transform=` cuts
    each whole value, fp32 and every optimizer state alike (a tensor-parallel rank's rows)."""
    uni = saved["root"] / "s2-fp32" / f"{TAG}_universal"
    whole = ds_zero.load_universal_partitions(uni)
    shapes = ds_comm.load_checkpoint_file(ds_zero.universal_model_states_file(uni))["param_shapes"]
    mine = [{name: shape} for name, shape in (next(iter(group.items())) for group in shapes)]  # one per group
    cut = [{name: [shape[0] // 2, *shape[1:]]} for group in mine for name, shape in group.items()]
    calls = []

    def top_rows(name: str, value: torch.Tensor) -> torch.Tensor:
        calls.append((name, tuple(value.shape)))
        return value[: value.shape[0] // 2]

    parts = ds_zero.load_universal_partitions(uni, param_shapes=cut, transform=top_rows)
    assert {name for name, _ in calls} == {n for group in mine for n in group}
    saved_shapes = {name: tuple(shape) for group in mine for name, shape in group.items()}
    assert all(shape == saved_shapes[name] for name, shape in calls)  # whole values, in their saved shape
    full, rows = ds_zero.consolidate_fp32_params(whole), ds_zero.consolidate_fp32_params(parts)
    assert sorted(rows) == sorted(n for group in cut for n in group)
    for g, group in enumerate(mine):
        (name, shape), (_, local) = next(iter(group.items())), next(iter(cut[g].items()))
        assert torch.equal(rows[name], full[name][: shape[0] // 2]), name
        # the optimizer state of the group is exactly this parameter's top rows, like its weight
        exp_avg = ds_comm.load_checkpoint_file(uni / "zero" / name / "exp_avg.pt")["param"]
        held = parts[0]["base_optimizer_state"]["state"][g]["exp_avg"]
        assert torch.equal(held, exp_avg[: shape[0] // 2].reshape(-1)), name
        assert held.numel() == math.prod(local)


def test_to_deepspeed_without_saved_param_shapes_lays_out_the_model_order(saved: dict, tmp_path: Path) -> None:
    """A model-states file without `param_shapes` (a pipeline stage's): the order comes from every rank's
    fragments, so DeepSpeed's files are the same as with the saved shapes."""
    from ds_zero.to_deepspeed import convert_to_deepspeed

    src = saved["root"] / "s2-fp32"
    stripped = tmp_path / "stripped"
    shutil.copytree(src / TAG, stripped / TAG)
    states = ds_comm.load_checkpoint_file(stripped / TAG / "mp_rank_00_model_states.pt")
    torch.save({**states, "param_shapes": None}, stripped / TAG / "mp_rank_00_model_states.pt")
    want = convert_to_deepspeed(src, tmp_path / "want", tag=TAG)
    got = convert_to_deepspeed(stripped, tmp_path / "got", tag=TAG)
    for path in sorted(want.glob("*optim_states.pt")):
        a = ds_comm.load_checkpoint_file(path)["optimizer_state_dict"]
        b = ds_comm.load_checkpoint_file(got / path.name)["optimizer_state_dict"]
        assert [list(m) for m in a["param_slice_mappings"]] == [list(m) for m in b["param_slice_mappings"]]
        for x, y in zip(a["single_partition_of_fp32_groups"], b["single_partition_of_fp32_groups"], strict=True):
            assert torch.equal(x, y), path.name
