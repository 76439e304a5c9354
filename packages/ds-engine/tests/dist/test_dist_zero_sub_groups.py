"""`engine._get_zero_param_shapes()` and stage 3's `_set/_clear_fp32_optimizer_param_groups`, on 2 gloo ranks.

DeepSpeed's universal-checkpoint tests lay the base optimizer's state out per parameter from these: the
state of sub-group k (one entry of `optimizer.optimizer.state_dict()["state"]`) is every rank's flat
partition of the parameters `_get_zero_param_shapes()[k]` names, each parameter `ceil(numel / N)`
elements per rank. Checked here against the per-parameter ZeRO accessor
(`safe_get_full_optimizer_state`), which reads the same state through another path; exact equality.

Also the checkpoint file-name methods (`_get_ckpt_name`, ...) name files `save_checkpoint` wrote.

Needs ds-zero (the `ds-engine[all]` session); skipped where it is not installed.
"""

from __future__ import annotations

import contextlib
import math
import os
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")

WORLD = 2


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(10, 24)
        self.b = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.b(torch.tanh(self.a(x))), y)


def _engine(stage: int, **zero: Any) -> Any:
    import ds_engine

    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "zero_optimization": {"stage": stage, **zero},
    }
    torch.manual_seed(0)
    with ds_engine.zero.Init() if stage == 3 else contextlib.nullcontext():
        model = Net()
    engine, *_ = ds_engine.initialize(model=model, config=config)
    return engine


def _train(engine: Any, rank: int, steps: int = 3) -> None:
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        engine.backward(engine(torch.randn(4, 10, generator=g), torch.randn(4, 5, generator=g)))
        engine.step()


def _gathered(t: torch.Tensor) -> torch.Tensor:
    import ds_comm

    parts = [torch.empty_like(t) for _ in range(ds_comm.get_world_size())]
    ds_comm.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _per_param_state(rank: int, world: int, stage: int, zero: dict[str, Any]) -> dict[str, Any]:
    from ds_engine.utils import safe_get_full_optimizer_state

    engine = _engine(stage, **zero)
    _train(engine, rank)
    shapes = engine._get_zero_param_shapes()
    if stage == 3:
        engine.optimizer._set_fp32_optimizer_param_groups()
    state = engine.optimizer.optimizer.state_dict()["state"]
    if stage == 3:
        engine.optimizer._clear_fp32_optimizer_param_groups()
    assert len(state) == len(shapes), (len(state), [list(s) for s in shapes])
    names = {n: p for n, p in engine.module.named_parameters()}
    assert [n for group in shapes for n in group] == list(names)
    mismatches = []
    for k, group in enumerate(shapes):
        flat = _gathered(state[k]["exp_avg"])
        per_rank = flat.numel() // world
        at = 0
        for name, shape in group.items():
            numel = math.prod(shape)
            if stage == 3:  # each rank holds ceil(numel / N) of it at the same offset of its partition
                part = math.ceil(numel / world)
                pieces = [flat[r * per_rank + at : r * per_rank + at + part] for r in range(world)]
                value = torch.cat(pieces)[:numel]
                at += part
            else:  # stages 1/2: the group's flat buffer is cut in N equal pieces
                value = flat[at : at + numel]
                at += numel
            expected = safe_get_full_optimizer_state(names[name], "exp_avg")
            if not torch.equal(value.view(shape), expected):
                mismatches.append(name)
    return {"mismatches": mismatches, "sub_groups": len(shapes)}


@pytest.mark.parametrize(
    ("stage", "zero", "sub_groups"),
    [(1, {}, 1), (2, {}, 1), (3, {}, 1), (3, {"sub_group_size": 70}, 3)],
    ids=["stage1", "stage2", "stage3", "stage3_tiles"],
)
def test_sub_group_shapes_lay_out_the_base_optimizer_state(stage: int, zero: dict[str, Any], sub_groups: int) -> None:
    for result in run_ranks(WORLD, _per_param_state, stage=stage, zero=zero, timeout_s=180):
        assert result == {"mismatches": [], "sub_groups": sub_groups}


def _set_restores(rank: int, world: int) -> dict[str, Any]:
    engine = _engine(3, sub_group_size=70)
    base = engine.optimizer.optimizer
    held = [list(g["params"]) for g in base.param_groups]
    base.param_groups[0]["params"] = []  # what DeepSpeed's resting state looks like
    engine.optimizer._set_fp32_optimizer_param_groups()
    restored = [list(g["params"]) for g in base.param_groups]
    engine.optimizer._clear_fp32_optimizer_param_groups()
    before = engine.optimizer.fp32_partitioned_groups_flat[0].clone()
    _train(engine, rank, steps=1)  # ds steps whatever the groups hold: they must still hold every tile
    after = engine.optimizer.fp32_partitioned_groups_flat[0]
    return {
        "restored": all(a is b for x, y in zip(held, restored, strict=True) for a, b in zip(x, y, strict=True))
        and [len(x) for x in held] == [len(y) for y in restored],
        "stepped": not torch.equal(before, after),
    }


def test_set_fp32_param_groups_restores_emptied_groups() -> None:
    assert run_ranks(WORLD, _set_restores, timeout_s=180) == [{"restored": True, "stepped": True}] * WORLD


def _no_zero(rank: int, world: int) -> str:
    engine = _engine(0)
    with pytest.raises(RuntimeError, match="stage 0") as info:
        engine._get_zero_param_shapes()
    return str(info.value)


def test_zero_param_shapes_without_zero_is_a_clear_error() -> None:
    assert all("_get_zero_param_shapes" in m for m in run_ranks(WORLD, _no_zero, timeout_s=120))


def _file_names(rank: int, world: int, save_dir: str, stage: int) -> dict[str, Any]:
    engine = _engine(stage)
    _train(engine, rank, steps=1)
    engine.save_checkpoint(save_dir, tag="t1")
    return {
        "model": os.path.isfile(engine._get_ckpt_name(save_dir, "t1")),
        "zero": os.path.isfile(engine._get_zero_ckpt_name(save_dir, "t1")),
        "zero_name": os.path.basename(engine._get_zero_ckpt_name(save_dir, "t1")),
        "all_mp": os.path.basename(engine._get_ckpt_name(save_dir, "t1", mp_placeholder="*")),
        "expert_optim": os.path.relpath(engine._get_optimizer_ckpt_name(save_dir, "t1", 1), save_dir),
    }


@pytest.mark.parametrize("stage", [1, 3])
def test_checkpoint_name_methods_name_the_saved_files(stage: int, tmp_path) -> None:
    results = run_ranks(WORLD, _file_names, save_dir=str(tmp_path), stage=stage, timeout_s=180)
    for rank, result in enumerate(results):
        assert result == {
            "model": True,
            "zero": True,
            "zero_name": f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt",
            "all_mp": "mp_rank_*_model_states.pt",
            "expert_optim": os.path.join("t1", "expp_rank_1_mp_rank_00_optim_states.pt"),
        }
