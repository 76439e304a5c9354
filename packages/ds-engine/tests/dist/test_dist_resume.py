"""Resume on 2 gloo ranks: train 20 steps; or save at 10 and continue in fresh processes: identical losses."""

from __future__ import annotations

import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_comm.testing import run_ranks

GAS = 2
CONFIG = base_config(
    gradient_accumulation_steps=GAS,
    gradient_clipping=1.0,
    scheduler={
        "type": "WarmupDecayLR",
        "params": {"total_num_steps": 20, "warmup_num_steps": 5, "warmup_max_lr": 1e-2},
    },
)


def _train(rank: int, world: int, save_dir: str, phase: str) -> list[float]:
    model = tiny_net(seed=0 if phase != "second" else 42, dropout=0.2)
    engine = make_engine(model, CONFIG)
    torch.manual_seed(1000 + rank)  # per-rank dropout streams: the checkpoint must restore each rank's
    data = batches(20 * GAS, 4, seed=200 + rank)
    start, stop = {"full": (0, 20), "first": (0, 10), "second": (10, 20)}[phase]
    if phase == "second":
        path, client = engine.load_checkpoint(save_dir)
        assert path is not None and client["epoch"] == 3 and engine.global_steps == 10
        torch.manual_seed(12345)  # any drift in RNG handling would now show
        engine.load_checkpoint(save_dir)
    losses = []
    for step in range(start, stop):
        for micro in range(GAS):
            x, y = data[step * GAS + micro]
            loss = loss_fn(engine(x), y)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
    if phase == "first":
        engine.save_checkpoint(save_dir, client_state={"epoch": 3})
    return losses


def _full_then_first(rank: int, world: int, save_dir: str) -> tuple[list[float], list[float]]:
    # Both runs reseed everything they use, so sharing a process does not couple them.
    return _train(rank, world, save_dir, "full"), _train(rank, world, save_dir, "first")


def test_resume_from_step_10_in_fresh_processes_is_identical(tmp_path) -> None:
    before = run_ranks(2, _full_then_first, save_dir=str(tmp_path), timeout_s=120)
    second = run_ranks(2, _train, save_dir=str(tmp_path), phase="second", timeout_s=120)
    assert (tmp_path / "latest").read_text() == "global_step10"
    for rank in range(2):
        full, first = before[rank]
        assert len(full) == 40 and first + second[rank] == full
