"""`checkpoint.layout: "deepspeed"` on 2 gloo ranks: the engine's own save is `to_deepspeed`'s output, and loads.

For ZeRO 1/2/3 in fp32 and bf16, ZeRO-2 in fp16, ZeRO-2 with CPU offload and a 2-stage ZeRO-1 pipeline,
two engines train the same steps on the same data, one saving in ds's layout and one in DeepSpeed's. Then:

* every file of the DeepSpeed-layout save equals, key for key and value for value (tensors bit for bit),
  what `ds_zero.to_deepspeed` writes from the ds-layout save, and no file is missing or extra
  (`ds_config` aside, whose `checkpoint.layout` is the one setting the two runs differ in);
* fresh engines loading either save continue identically (losses and parameters bit for bit), on the
  2 ranks they were saved at, and on 1 rank at another ZeRO stage (ds reads DeepSpeed's layout at any
  world size and stage).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

import ds_comm
from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero")

STEPS_BEFORE, STEPS_AFTER, TAG = 3, 2, "global_step3"
CASES: dict[str, dict[str, Any]] = {
    # each stage once, each dtype at least once (a full stage x dtype grid costs 8 s a case for nothing new)
    "z1_bf16": {"stage": 1, "dtype": "bf16"},
    "z2_fp32": {"stage": 2, "dtype": "fp32"},
    "z3_bf16": {"stage": 3, "dtype": "bf16"},
    "z2_fp16": {"stage": 2, "dtype": "fp16"},
    "z2_fp32_offload": {"stage": 2, "dtype": "fp32", "offload": True},
    "pipe_z1_fp32": {"stage": 1, "dtype": "fp32", "pipe": True},
}
#: without ZeRO, ds's files are DeepSpeed's: the layout changes only `ds_version`
STAGE0_CASES: dict[str, dict[str, Any]] = {
    "z0_bf16": {"stage": 0, "dtype": "bf16"},
    "pipe_z0_fp32": {"stage": 0, "dtype": "fp32", "pipe": True},
}
CASES.update(STAGE0_CASES)
#: the ZeRO stage each save is reloaded at on 1 rank
OTHER_STAGE = {1: 3, 2: 1, 3: 2}


def _config(case: str, layout: str, *, stage: int | None = None) -> dict[str, Any]:
    spec = CASES[case]
    zero: dict[str, Any] = {"stage": spec["stage"] if stage is None else stage}
    if spec.get("offload"):
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = base_config(
        zero_optimization=zero,
        checkpoint={"layout": layout},
        scheduler={"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 10}},
    )
    if spec.get("pipe"):
        cfg["train_micro_batch_size_per_gpu"] = 2
        cfg["gradient_accumulation_steps"] = 2
    if spec["dtype"] == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif spec["dtype"] == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 8}
    return cfg


def _pipe_model() -> Any:
    from ds_pipe import PipelineModule

    torch.manual_seed(0)
    layers = [torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4)]
    return PipelineModule(layers=layers, num_stages=2, loss_fn=loss_fn, partition_method="uniform")


def _engine(case: str, layout: str, *, stage: int | None = None) -> Any:
    model = _pipe_model() if CASES[case].get("pipe") else tiny_net(seed=0)
    return make_engine(model, _config(case, layout, stage=stage))


def _train(engine: Any, case: str, first: int, steps: int, rank: int, world: int) -> list[float]:
    """`steps` optimizer steps from step `first`; each rank's data depend on (step, rank, world) only."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[CASES[case]["dtype"]]
    losses = []
    for step in range(first, first + steps):
        data = batches(2, 2 if CASES[case].get("pipe") else 4, seed=100 * step + (rank if world > 1 else 0))
        data = [(x.to(dtype), y) for x, y in data]
        if CASES[case].get("pipe"):
            losses.append(float(engine.train_batch(data_iter=iter(data))))
            continue
        x, y = data[0]
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _save_both(rank: int, world: int, root: str, case: str) -> None:
    for layout in ("ds", "deepspeed"):
        engine = _engine(case, layout)
        _train(engine, case, 0, STEPS_BEFORE, rank, world)
        torch.manual_seed(7)  # the RNG states saved are the same in both runs
        engine.save_checkpoint(str(Path(root) / layout), client_state={"epoch": 3})


def _continue(rank: int, world: int, root: str, case: str, stage: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in ("ds", "deepspeed"):
        engine = _engine(case, "ds", stage=stage)
        path, client = engine.load_checkpoint(str(Path(root) / layout))
        assert path is not None and client["epoch"] == 3 and engine.global_steps == STEPS_BEFORE
        losses = _train(engine, case, STEPS_BEFORE, STEPS_AFTER, rank, world)
        out[layout] = (losses, flat_params(engine.module), engine.get_lr())
    return out


def _drop_layout(value: Any) -> Any:
    """A saved ds_config without `checkpoint.layout` (the only setting the two runs differ in)."""
    out = copy.deepcopy(dict(value))
    out.get("checkpoint", {}).pop("layout", None)
    return out


def _assert_same(a: Any, b: Any, where: str) -> None:
    assert type(a) is type(b), f"{where}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), where
    elif isinstance(a, Mapping):
        assert list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            if key == "ds_config":
                assert _drop_layout(a[key]) == _drop_layout(b[key]), f"{where}.ds_config"
            else:
                _assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_same(x, y, f"{where}[{i}]")
    elif type(a).__module__ == "numpy" and hasattr(a, "tolist"):  # the numpy RNG state
        assert a.tolist() == b.tolist(), where
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        _assert_same(vars(a), vars(b), f"{where}<{type(a).__name__}>")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [c for c in CASES if c not in STAGE0_CASES])
def test_deepspeed_layout_save_is_to_deepspeed_output_and_continues_like_ds(case: str, tmp_path: Path) -> None:
    from ds_zero.to_deepspeed import convert_to_deepspeed

    run_ranks(2, _save_both, root=str(tmp_path), case=case, timeout_s=240)
    converted = tmp_path / "converted"
    convert_to_deepspeed(tmp_path / "ds", converted)
    mine = tmp_path / "deepspeed"
    assert _files(mine) == _files(converted), "the save and to_deepspeed's output hold different files"
    assert (mine / "latest").read_text() == TAG
    assert not any(p.name.startswith(".") for p in mine.iterdir()), "the staging directory was left behind"
    for name in _files(mine):
        if name.endswith(".pt"):
            ours = ds_comm.load_checkpoint_file(mine / name)
            theirs = ds_comm.load_checkpoint_file(converted / name)
            if "/layer_" not in name:  # a pipeline's layer files hold the layer's state_dict only
                assert ours["ds_version"] == "0.19.8", name
            _assert_same(ours, theirs, name)
        else:
            assert (mine / name).read_bytes() == (converted / name).read_bytes(), name

    after = run_ranks(2, _continue, root=str(tmp_path), case=case, timeout_s=240)
    for rank in range(2):
        _assert_same(after[rank]["deepspeed"], after[rank]["ds"], f"rank {rank} continuation")
    if CASES[case].get("pipe"):
        return  # a pipeline's optimizer state loads into the stage layout it was saved with
    other = OTHER_STAGE[CASES[case]["stage"]]
    single = run_ranks(1, _continue, root=str(tmp_path), case=case, stage=other, timeout_s=240)[0]
    _assert_same(single["deepspeed"], single["ds"], f"1 rank at ZeRO stage {other}")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(STAGE0_CASES))
def test_deepspeed_layout_without_zero_is_ds_layout_with_deepspeeds_version(case: str, tmp_path: Path) -> None:
    run_ranks(2, _save_both, root=str(tmp_path), case=case, timeout_s=240)
    mine, plain = tmp_path / "deepspeed", tmp_path / "ds"
    assert _files(mine) == _files(plain)
    assert not any(name.endswith("optim_states.pt") or name == "zero_to_fp32.py" for name in _files(mine))
    for name in _files(mine):
        if not name.endswith(".pt"):
            assert (mine / name).read_bytes() == (plain / name).read_bytes(), name
            continue
        ours, theirs = ds_comm.load_checkpoint_file(mine / name), ds_comm.load_checkpoint_file(plain / name)
        if "/layer_" not in name:
            assert ours["ds_version"] == "0.19.8" and theirs["ds_version"] != "0.19.8", name
            theirs["ds_version"] = ours["ds_version"]
            # DeepSpeed's files hold no RNG state; ds's own layout saves each rank's
            assert "rng_states" not in ours and "rng_states" in theirs, name
            del theirs["rng_states"]
        _assert_same(ours, theirs, name)
    after = run_ranks(2, _continue, root=str(tmp_path), case=case, timeout_s=240)
    for rank in range(2):
        _assert_same(after[rank]["deepspeed"], after[rank]["ds"], f"rank {rank} continuation")
