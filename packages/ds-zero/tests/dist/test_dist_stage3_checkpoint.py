"""Stage-3 checkpoints: same-world resume is bit-exact, 2 -> 4 ranks re-partitions, zero_to_fp32 consolidates.

The 4-rank resume also cuts the optimizer step into tiles (`sub_group_size`), a different layout again.

Saved with `ds_zero.save_zero_checkpoint` in DeepSpeed's layout and the shared ZeRO partition format;
each global batch is split evenly over the ranks, so 2 and 4 ranks train the same model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from stage3_cases import SEQ, STAGE3_CFG, VOCAB, gathered_state, loss_fn, make_model

import ds_zero
from ds_comm.testing import run_ranks

GLOBAL_BATCH = 8


def _global_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    idx = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    rows = GLOBAL_BATCH // world
    return idx[rank * rows : (rank + 1) * rows], tgt[rank * rows : (rank + 1) * rows]


def _setup(sub_group_size: int = 1_000_000_000) -> tuple[torch.nn.Module, ds_zero.DeepSpeedZeroOptimizer_Stage3]:
    model = make_model()
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.01)
    config = dict(STAGE3_CFG, sub_group_size=sub_group_size)
    return model, ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=config, clip_grad=1.0)


def _train(model: torch.nn.Module, opt: Any, rank: int, world: int, steps: range) -> list[float]:
    losses = []
    for step in steps:
        idx, tgt = _global_batch(step, rank, world)
        loss = loss_fn(model(idx), tgt)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _train_save_continue_resume(rank: int, world: int, save_dir: str) -> dict[str, Any]:
    """Train 3 steps, save, train 3 more; then a fresh model and optimizer load the save and train the same 3."""
    model, opt = _setup()
    _train(model, opt, rank, world, range(0, 3))
    saved = gathered_state(model)
    ds_zero.save_zero_checkpoint(save_dir, "step3", opt, model)
    losses = _train(model, opt, rank, world, range(3, 6))
    return {"saved": saved, "losses": losses, "final": gathered_state(model), "resumed": _resume(rank, world, save_dir)}


def _resume(rank: int, world: int, save_dir: str, sub_group_size: int = 1_000_000_000) -> dict[str, Any]:
    model, opt = _setup(sub_group_size)
    ds_zero.load_zero_checkpoint(save_dir, opt, model)
    losses = _train(model, opt, rank, world, range(3, 6))
    return {
        "losses": losses,
        "final": gathered_state(model),
        "tiles": len(opt.tiles),
        "step": opt.optimizer.state_dict()["state"][0]["step"],
    }


@pytest.mark.timeout(300)  # several trainings on up to 4 ranks sharing the host's cores
def test_resume_is_bit_exact_repartitions_to_4_ranks_and_consolidates(tmp_path: Path) -> None:
    save_dir = str(tmp_path / "ckpt")
    first = run_ranks(2, _train_save_continue_resume, save_dir=save_dir, timeout_s=120)
    for r in first:
        assert r["resumed"]["losses"] == r["losses"]
        for key, value in r["final"].items():
            torch.testing.assert_close(r["resumed"]["final"][key], value, atol=0, rtol=0)
    # 4 ranks, and the optimizer step tiled (sub_group_size) where the save had one tile per group
    wider = run_ranks(4, _resume, save_dir=save_dir, sub_group_size=1500, timeout_s=180)
    assert wider[0]["tiles"] > 1 and float(wider[0]["step"]) == 6.0
    # the 2-rank losses are the mean over rows 0-3 / 4-7; the 4-rank ones over rows 0-1 / 2-3 / ...
    torch.testing.assert_close(
        torch.tensor(wider[0]["losses"]) + torch.tensor(wider[1]["losses"]),
        2 * torch.tensor(first[0]["losses"]),
        atol=1e-5,
        rtol=1e-5,
    )
    for key, value in first[0]["final"].items():
        torch.testing.assert_close(
            wider[3]["final"][key], value, atol=1e-5, rtol=1e-4, msg=lambda m, k=key: f"{k}: {m}"
        )
    # zero_to_fp32: every parameter (frozen ones too), buffers, tied alias; equal to the model at save time
    consolidated = ds_zero.get_fp32_state_dict_from_zero_checkpoint(save_dir)
    assert set(consolidated) == set(first[0]["saved"])
    for key, value in first[0]["saved"].items():
        torch.testing.assert_close(consolidated[key].float(), value, atol=0, rtol=0, msg=lambda m, k=key: f"{k}: {m}")
    plain = make_model(seed=5)
    plain.load_state_dict(consolidated)
