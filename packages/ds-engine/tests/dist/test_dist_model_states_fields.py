"""The tied- and frozen-parameter fields of a ZeRO save's model-states files, as DeepSpeed 0.19.8 writes them
(2 gloo ranks, ZeRO 1/2/3, ds's and DeepSpeed's layout).

DeepSpeed's `zero_to_fp32.py` reads `shared_params` (and fails on None), `frozen_param_shapes` and
`frozen_param_fragments`. DeepSpeed writes `shared_params` as `{alias: stored name}` under ZeRO (global
rank 0's file; `{}` in the other ranks' stage-3 files), and the frozen fields from stage 2 on (None at
stage 1 and with `exclude_frozen_parameters`): shapes as `torch.Size`, fragments as the whole parameter
at stage 2 and, at stage 3, each rank's flat slice (`ceil(numel / world)` elements, zero-padded) in its
own file. ds's one-file layout holds the whole flattened parameter there instead, which DeepSpeed's
reader joins the same way. Read back by DeepSpeed's rules (here, in a few lines), every save gives the
model's weights; so does ds-zero's consolidation. The model: a frozen layer, tied weights, a
one-element parameter and sizes 2 ranks do not divide.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine

import ds_comm
from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero")

FROZEN = ["frozen.weight", "frozen.bias"]


class TiedFrozenNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 7)
        self.mid = torch.nn.Linear(7, 7)
        self.mid_tied = torch.nn.Linear(7, 7)
        self.mid_tied.weight = self.mid.weight
        self.frozen = torch.nn.Linear(7, 5)
        self.frozen.requires_grad_(False)
        self.fc2 = torch.nn.Linear(5, 4)
        self.scale = torch.nn.Parameter(torch.ones(1))
        self.register_buffer("buf", torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.mid_tied(torch.tanh(self.mid(torch.tanh(self.fc1(x))))))
        return self.fc2(torch.tanh(self.frozen(h))) * self.scale


def _save(rank: int, world: int, stage: int, layout: str, root: str, exclude: bool) -> dict[str, torch.Tensor]:
    import ds_zero

    torch.manual_seed(0)
    model = TiedFrozenNet()
    config = base_config(zero_optimization={"stage": stage}, checkpoint={"layout": layout})
    engine = make_engine(model, config, model_parameters=[p for p in model.parameters() if p.requires_grad])
    for x, y in batches(2, 4, seed=10 + rank):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    engine.save_checkpoint(root, tag="t", exclude_frozen_parameters=exclude)
    if stage == 3:
        return ds_zero.consolidated_16bit_state_dict(engine.module, rank0_only=False)
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _model_states(tag: Path) -> list[dict[str, Any]]:
    files = sorted(tag.glob("zero_pp_rank_*_mp_rank_00_model_states.pt")) or [tag / "mp_rank_00_model_states.pt"]
    return [ds_comm.load_checkpoint_file(f) for f in files]


def _frozen_by_deepspeeds_rules(states: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """What DeepSpeed's zero_to_fp32 does with the fields: join every file's fragment, cut, reshape."""
    out = {}
    for name, shape in (states[0]["frozen_param_shapes"] or {}).items():
        flat = torch.cat([s["frozen_param_fragments"][name].reshape(-1) for s in states])
        out[name] = flat.narrow(0, 0, shape.numel()).view(shape)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["ds", "deepspeed"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fields_are_deepspeeds_and_rebuild_the_weights(stage: int, layout: str, tmp_path: Path) -> None:
    from ds_zero import get_fp32_state_dict_from_zero_checkpoint

    want = run_ranks(2, _save, stage, layout, str(tmp_path), False, timeout_s=240)[0]
    states = _model_states(tmp_path / "t")
    assert len(states) == (2 if stage == 3 and layout == "deepspeed" else 1)
    assert states[0]["shared_params"] == {"mid_tied.weight": "mid.weight"}
    assert all(s["shared_params"] == {} for s in states[1:])
    if stage == 1:
        assert states[0]["frozen_param_shapes"] is None and states[0]["frozen_param_fragments"] is None
    else:
        shapes = states[0]["frozen_param_shapes"]
        assert list(shapes) == FROZEN and all(type(s) is torch.Size for s in shapes.values())
        assert shapes["frozen.weight"] == torch.Size([5, 7])
        frozen = _frozen_by_deepspeeds_rules(states)
        for name in FROZEN:
            assert torch.equal(frozen[name], want[name]), name
        if stage == 3 and layout == "deepspeed":  # each rank's slice: ceil(numel / 2) elements, zero-padded
            bias = [s["frozen_param_fragments"]["frozen.bias"] for s in states]
            assert [b.numel() for b in bias] == [3, 3] and bias[1][-1] == 0
            assert all(s["module"]["frozen.weight"].numel() == 0 for s in states)  # placeholders, as DeepSpeed
    got = get_fp32_state_dict_from_zero_checkpoint(tmp_path)
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert torch.equal(got[name], value.float()), name
    assert got["mid_tied.weight"] is got["mid.weight"]


def test_exclude_frozen_parameters_records_none(tmp_path: Path) -> None:
    run_ranks(2, _save, 2, "ds", str(tmp_path), True, timeout_s=240)
    state = _model_states(tmp_path / "t")[0]
    assert state["frozen_param_shapes"] is None and state["frozen_param_fragments"] is None
    assert not set(FROZEN) & set(state["module"]) and state["shared_params"] == {"mid_tied.weight": "mid.weight"}


def test_a_frozen_fragment_costs_no_bytes_in_ds_layout(tmp_path: Path) -> None:
    """ds's one-file layout: a fragment is the module entry itself (or its flat view), stored once."""
    import ds_zero

    value = torch.randn(5, 7)
    module = {"frozen.weight": value}
    for stage in (2, 3):
        _, fragments = ds_zero.frozen_fields(module, ["frozen.weight"], stage=stage)
        frag = fragments["frozen.weight"]
        assert frag.untyped_storage().data_ptr() == value.untyped_storage().data_ptr()
        assert frag.shape == (value.shape if stage == 2 else (35,))
    sliced = [ds_zero.stage3_fragment(value, r, 2) for r in (0, 1)]
    assert [s.numel() for s in sliced] == [math.ceil(35 / 2)] * 2
    assert torch.equal(torch.cat(sliced)[:35].view(5, 7), value) and sliced[1][-1] == 0
