"""MoE checkpoints: DeepSpeed's file layout, and a save at ep_size 2 resumed at ep_size 2 and at ep_size 1.

A run of 10 steps saves, a fresh engine loads and trains 10 more: the losses of steps 10-19 must equal
those of an uninterrupted all-experts reference (so weights, optimizer state and counters all carried over).

Needs ds-parallel (the `ds-engine[all]` session); skipped without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="MoE needs ds-parallel: pip install 'ds-engine[parallel]'")

STEPS, LR = 20, 1e-2


def _engine(ep_size: int, stage: int) -> Any:
    from moe_cases import TinyMoE, config

    import ds_engine as deepspeed

    torch.manual_seed(0)
    model = TinyMoE(ep_size=ep_size)
    engine, *_ = deepspeed.initialize(model=model, config=config(stage, 0.3, LR))
    return engine


def _save_then_resume(rank: int, world: int, root: str, save_ep: int, load_ep: int, stage: int) -> dict[str, Any]:
    from moe_cases import batch, reference_run

    from ds_parallel import groups

    _, ref_losses = reference_run(world, STEPS, LR, 0.3)
    # Seeded alike on every rank, and experts start as copies of one module: the reference's weights.
    engine = _engine(save_ep, stage)
    for step in range(STEPS // 2):
        loss = engine(*batch(rank, step))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, tag="mid")
    files = sorted(p.name for p in (Path(root) / "mid").iterdir())
    groups.reset_mesh()

    resumed = _engine(load_ep, stage)
    resumed.load_checkpoint(root, tag="mid")
    err = 0.0
    for step in range(STEPS // 2, STEPS):
        loss = resumed(*batch(rank, step))
        resumed.backward(loss)
        resumed.step()
        err = max(err, abs(float(loss) - ref_losses[step][rank]))
    model_states = torch.load(Path(root) / "mid" / "mp_rank_00_model_states.pt", weights_only=False)
    return {
        "err": err,
        "files": files,
        "module_keys": sorted(model_states["module"]),
        "global_steps": resumed.global_steps,
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("save_ep", "load_ep", "stage"), [(2, 2, 0), (2, 1, 2)])
def test_moe_checkpoint_resumes_at_the_same_or_another_ep_size(
    tmp_path: Path, save_ep: int, load_ep: int, stage: int
) -> None:
    results = run_ranks(2, _save_then_resume, str(tmp_path), save_ep, load_ep, stage, timeout_s=540)
    for r in results:
        assert r["err"] <= 1e-6, r
        assert r["global_steps"] == STEPS
    files = results[0]["files"]
    for layer in (0, 1):
        for expert in range(4):
            assert f"layer_{layer}_expert_{expert}_mp_rank_00_model_states.pt" in files
    assert "mp_rank_00_model_states.pt" in files
    if stage == 0:
        assert {"expp_rank_0_mp_rank_00_optim_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"} <= set(files)
    else:
        assert {"zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"} <= set(files)
    keys = results[0]["module_keys"]
    assert not any("deepspeed_experts" in k for k in keys)
    assert "moe.0.deepspeed_moe.gate.wg.weight" in keys


def _stage0_other_ep(rank: int, world: int, root: str) -> str:
    from ds_parallel import groups

    engine = _engine(2, 0)
    engine.save_checkpoint(root, tag="t")
    groups.reset_mesh()
    other = _engine(1, 0)
    try:
        other.load_checkpoint(root, tag="t")
    except ValueError as err:
        return str(err)
    return "no error"


def test_stage0_optimizer_state_at_another_ep_size_is_refused_by_name(tmp_path: Path) -> None:
    msg = run_ranks(2, _stage0_other_ep, str(tmp_path), timeout_s=240)[0]
    assert "load_optimizer_states=False" in msg


def _load_moe_state_dict_by_hand(rank: int, world: int, root: str, load_ep: int) -> dict[str, Any]:
    from moe_cases import TinyMoE, batch

    from ds_engine import DeepSpeedEngine
    from ds_parallel import groups

    engine = _engine(2, 2)
    for step in range(3):
        loss = engine(*batch(rank, step))
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, tag="mid")
    trained = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    ep_rank = groups._get_expert_parallel_rank(engine.module.moe[0].expert_group_name)
    groups.reset_mesh()

    # A Megatron-style load: the model-states file read by the script, experts added by DeepSpeed's helper.
    torch.manual_seed(1)
    model = TinyMoE(ep_size=load_ep)
    for sub in model.modules():
        if sub is not model and hasattr(sub, "set_deepspeed_parallelism"):
            sub.set_deepspeed_parallelism()
    state = torch.load(Path(root) / "mid" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    DeepSpeedEngine.load_moe_state_dict(root, "mid", state_dict=state, model=model)
    model.load_state_dict(state, strict=True)
    new_rank = groups._get_expert_parallel_rank(model.moe[0].expert_group_name)
    return {
        "trained": trained,
        "loaded": model.state_dict(),
        "save_ep_rank": ep_rank,
        "load_ep_rank": new_rank,
        "num_local": model.moe[0].num_local_experts,
    }


@pytest.mark.timeout(600)
@pytest.mark.parametrize("load_ep", [2, 1])
def test_load_moe_state_dict_fills_local_experts_from_the_global_files(tmp_path: Path, load_ep: int) -> None:
    from moe_cases import global_name

    results = run_ranks(2, _load_moe_state_dict_by_hand, str(tmp_path), load_ep, timeout_s=540)
    # Every global expert, as the saving ranks held it (their local index -> global index).
    saved: dict[str, torch.Tensor] = {}
    for r in results:
        for name, value in r["trained"].items():
            saved[global_name(name, r["save_ep_rank"], 4 // 2)] = value
    for r in results:
        for name, value in r["loaded"].items():
            want = saved[global_name(name, r["load_ep_rank"], r["num_local"])]
            torch.testing.assert_close(value, want, rtol=0, atol=0, msg=name)
