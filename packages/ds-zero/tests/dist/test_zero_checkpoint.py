"""Checkpoints: resume at the same world size is bit-exact; a save on 2 ranks resumes on 4 and the other way
round (re-partitioned, within 1e-5 of continuing at the saved size); `zero_to_fp32` (function and console
script) rebuilds the model's state_dict exactly from the partitions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from zero_dist_cases import Tiny, flat_params, make_model, make_optimizer, train_zero, zero_config

import ds_zero
from ds_comm.testing import run_ranks
from ds_zero import zero_to_fp32

SAVE_AT, TOTAL = 4, 7
# name -> (stage, dtype) of a saved run
RUNS = {"s2-fp32": (2, torch.float32), "s1-bf16": (1, torch.bfloat16)}


def _build(stage: int, dtype: torch.dtype, seed: int = 0) -> tuple[Tiny, ds_zero.DeepSpeedZeroOptimizer]:
    model = make_model(seed=seed, dtype=dtype)
    config = zero_config(stage, overlap_comm=True, reduce_bucket_size=120, allgather_bucket_size=400)
    opt = ds_zero.DeepSpeedZeroOptimizer(make_optimizer(model), config=config, module=model, clip_grad=0.05)
    return model, opt


def _save_then_continue(rank: int, world: int, root: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        stage, dtype = RUNS[name]
        model, opt = _build(stage, dtype)
        train_zero(opt, model, rank, world, range(SAVE_AT), gas=2)
        ds_zero.save_zero_checkpoint(
            f"{root}/{name}",
            f"global_step{SAVE_AT}",
            opt,
            model,
            client_state={"my": 1},
            bf16_prefix=dtype == torch.bfloat16,
        )
        snapshot = {k: v.clone() for k, v in model.state_dict().items()}
        masters = [m.detach().clone() for m in opt.masters]
        losses = train_zero(opt, model, rank, world, range(SAVE_AT, TOTAL), gas=2)
        out[name] = {"snapshot": snapshot, "losses": losses, "params": flat_params(model), "masters": masters}
        opt.close()
    return out


def _load_then_continue(rank: int, world: int, root: str, names: list[str]) -> dict:
    out = {}
    for name in names:
        stage, dtype = RUNS[name]
        model, opt = _build(stage, dtype, seed=123)  # a different init: everything must come from disk
        path, client = ds_zero.load_zero_checkpoint(f"{root}/{name}", opt, model)
        assert path is not None and client["my"] == 1
        losses = train_zero(opt, model, rank, world, range(SAVE_AT, TOTAL), gas=2)
        out[name] = {"losses": losses, "params": flat_params(model)}
        opt.close()
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Checkpoints saved on 2 ranks (both runs) and on 4 ranks (s2-fp32), with their continuations."""
    root2, root4 = tmp_path_factory.mktemp("on2"), tmp_path_factory.mktemp("on4")
    on2 = run_ranks(2, _save_then_continue, root=str(root2), names=list(RUNS), timeout_s=120)
    on4 = run_ranks(4, _save_then_continue, root=str(root4), names=["s2-fp32"], timeout_s=120)
    return {"root2": root2, "root4": root4, "on2": on2, "on4": on4}


def test_layout_and_safe_loading(saved: dict) -> None:
    tag = saved["root2"] / "s2-fp32" / f"global_step{SAVE_AT}"
    assert (saved["root2"] / "s2-fp32" / "latest").read_text() == f"global_step{SAVE_AT}"  # no newline
    names = sorted(p.name for p in tag.iterdir())
    assert names == [
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
    ]
    bf16 = saved["root2"] / "s1-bf16" / f"global_step{SAVE_AT}"
    assert (bf16 / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").is_file()
    sd = torch.load(tag / names[1], weights_only=True)["optimizer_state_dict"]  # plain types only
    assert sd["ds_zero_format"] == ds_zero.CHECKPOINT_FORMAT_VERSION and sd["partition_count"] == 2
    assert sd["zero_stage"] == 2 and sd["dp_rank"] == 0 and sd["model_dtype"] == "float32"
    frags = [f for meta in sd["partitions"] for f in meta["fragments"]]
    assert frags[0] == ["emb.weight", 0, 77, 0]  # 153 elements in group 0: 77 per rank, emb.weight straddles
    assert "frozen.weight" in sd["frozen_param_shapes"]


def test_resume_same_world_size_is_bit_exact(saved: dict) -> None:
    loaded = run_ranks(2, _load_then_continue, root=str(saved["root2"]), names=list(RUNS), timeout_s=120)
    for rank in range(2):
        for name in RUNS:
            ref, got = saved["on2"][rank][name], loaded[rank][name]
            assert got["losses"] == ref["losses"], f"rank {rank} {name}: losses after resume differ"
            assert torch.equal(got["params"], ref["params"]), f"rank {rank} {name}: params differ"


def test_resume_2_to_4_and_4_to_2_repartitions(saved: dict) -> None:
    on4 = run_ranks(4, _load_then_continue, root=str(saved["root2"]), names=["s2-fp32"], timeout_s=120)
    on2 = run_ranks(2, _load_then_continue, root=str(saved["root4"]), names=["s2-fp32"], timeout_s=120)
    for got, ref, what in ((on4[0], saved["on2"][0], "2->4"), (on2[0], saved["on4"][0], "4->2")):
        ref, got = ref["s2-fp32"], got["s2-fp32"]
        err = max(abs(a - b) for a, b in zip(got["losses"], ref["losses"], strict=True))
        assert err <= 1e-5, f"{what}: losses after re-partitioned resume differ by {err}"
        assert float((got["params"] - ref["params"]).abs().max()) <= 1e-5, what
    # every rank of the 4-rank load holds the same model
    assert all(torch.equal(r["s2-fp32"]["params"], on4[0]["s2-fp32"]["params"]) for r in on4)


def test_zero_to_fp32_equals_the_gathered_model(saved: dict) -> None:
    fp32_sd = ds_zero.get_fp32_state_dict_from_zero_checkpoint(saved["root2"] / "s2-fp32")
    snapshot = saved["on2"][0]["s2-fp32"]["snapshot"]
    assert list(fp32_sd) == list(snapshot)  # same keys, module order (buffers, frozen params too)
    for key, value in snapshot.items():
        assert torch.equal(fp32_sd[key], value), key
    model = Tiny()
    model.load_state_dict(fp32_sd)  # strict
    # saved on 4 ranks: the same consolidation
    four = ds_zero.get_fp32_state_dict_from_zero_checkpoint(saved["root4"] / "s2-fp32")
    assert all(torch.equal(four[k], v) for k, v in saved["on4"][0]["s2-fp32"]["snapshot"].items())
    # bf16: fp32 masters (more precise than the bf16 weights, which they round to)
    bf16_sd = ds_zero.get_fp32_state_dict_from_zero_checkpoint(saved["root2"] / "s1-bf16")
    bf16_snapshot = saved["on2"][0]["s1-bf16"]["snapshot"]
    for key, value in bf16_snapshot.items():
        assert fp32_sd[key].shape == value.shape
        if key == "offset":
            continue
        assert bf16_sd[key].dtype == torch.float32, key
        assert torch.equal(bf16_sd[key].to(torch.bfloat16), value), key
    # the consolidated values are exactly the masters the ranks held, in each group's flat order
    groups = [["emb.weight", "emb.bias", "scale", "head.weight", "head.bias"], ["mid.weight"]]
    for g, names in enumerate(groups):
        expected = torch.cat([bf16_sd[k].reshape(-1) for k in names])
        held = torch.cat([saved["on2"][r]["s1-bf16"]["masters"][g] for r in range(2)])
        assert torch.equal(held[: expected.numel()], expected), names
        assert not held[expected.numel() :].any(), "padding must be zero"


def test_console_script_writes_a_loadable_state_dict(saved: dict, tmp_path: Path) -> None:
    out = tmp_path / "model_fp32"
    proc = subprocess.run(
        [sys.executable, "-m", "ds_zero.zero_to_fp32", str(saved["root2"] / "s2-fp32"), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "100.0%" in proc.stderr and "saved fp32 state_dict" in proc.stderr
    Tiny().load_state_dict(torch.load(out / "pytorch_model.bin", weights_only=True))


def test_convert_writes_deepspeeds_output_dir_layout(saved: dict, tmp_path: Path) -> None:
    """`convert_zero_checkpoint_to_fp32_state_dict(ckpt, output_dir)`: DeepSpeed's argument order; one
    `pytorch_model.bin`, or shards and an index below `max_shard_size`, equal to the consolidated dict."""
    ckpt = saved["root2"] / "s2-fp32"
    want = ds_zero.get_fp32_state_dict_from_zero_checkpoint(ckpt)
    out = ds_zero.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "one")
    assert out == tmp_path / "one" and sorted(p.name for p in out.iterdir()) == ["pytorch_model.bin"]
    one = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert list(one) == list(want) and all(torch.equal(one[k], v) for k, v in want.items())

    sharded = ds_zero.convert_zero_checkpoint_to_fp32_state_dict(ckpt, tmp_path / "many", max_shard_size=300)
    index = json.loads((sharded / "pytorch_model.bin.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and all(f.startswith("pytorch_model-") for f in files)
    merged = {k: v for f in files for k, v in torch.load(sharded / f, weights_only=True).items()}
    assert set(merged) == set(want) and all(torch.equal(merged[k], v) for k, v in want.items())

    half = ds_zero.convert_zero_checkpoint_to_state_dict(ckpt, tmp_path / "bf16", dtype="bf16", max_shard_size=None)
    low = torch.load(half / "pytorch_model.bin", weights_only=True)
    for key, value in want.items():
        expected = value.to(torch.bfloat16) if value.is_floating_point() else value
        assert low[key].dtype == expected.dtype and torch.equal(low[key], expected), key


def test_convert_refuses_a_file_name_before_reading(tmp_path: Path) -> None:
    # the checkpoint does not exist either: the output check comes first, and nothing is written
    with pytest.raises(ValueError, match="looks like a file name"):
        ds_zero.convert_zero_checkpoint_to_fp32_state_dict(tmp_path / "nope", tmp_path / "model.bin")
    with pytest.raises(ValueError, match="dtype='int8'"):
        ds_zero.convert_zero_checkpoint_to_state_dict(tmp_path / "nope", tmp_path / "out", dtype="int8")
    assert list(tmp_path.iterdir()) == []


def test_console_script_error_exit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert zero_to_fp32.main([str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "ds-zero-to-fp32: error: no 'latest' file" in capsys.readouterr().err
