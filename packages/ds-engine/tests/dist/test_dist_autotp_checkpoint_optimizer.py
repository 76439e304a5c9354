"""Optimizer state across tensor-parallel degrees: a TP=2 checkpoint resumed at TP=1, and a TP=1 one at TP=2.

A tiny HF Llama trained with AdamW (whose moments change the next steps) for 3 steps, saved, and resumed
at the other degree for 3 more steps gives the losses of the uninterrupted run (1e-5), at ZeRO 0, 1 and 2
(stage 0 also in bf16, whose fp32 masters travel too; 1e-2), and TP=2 x DP=2 under ZeRO 2 resumes at
TP=1 x DP=2. Resuming without the optimizer state gives other
losses, so the moments are what carried over.

Needs ds-parallel and transformers (the `ds-engine[all]` session); skipped without them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")
pytest.importorskip("transformers")

from tiny_hf_models import batch, build  # noqa: E402

FIRST, THEN = 3, 3


def _config(tp: int, stage: int, precision: str) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage},
    }
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    if tp > 1:
        cfg["tensor_parallel"] = {"autotp_size": tp}
    return cfg


def _steps(engine: Any, first: int, count: int) -> list[float]:
    losses = []
    dp, dp_rank = engine.dp_world_size, engine.get_data_parallel_rank()
    for step in range(first, first + count):
        ids = batch(seed=1000 + step * dp + dp_rank, size=2, seq=8)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train_and_save(
    rank: int, world: int, stage: int, precision: str, save_dir: str, tp: int | None = None
) -> list[float]:
    import ds_engine as deepspeed

    model = build("llama", kv_heads=2)
    model.train()
    engine, *_ = deepspeed.initialize(model=model, config=_config(tp or world, stage, precision))
    losses = _steps(engine, 0, FIRST)
    engine.save_checkpoint(save_dir, tag="mid")
    return losses + _steps(engine, FIRST, THEN)


def _resume(
    rank: int, world: int, stage: int, precision: str, save_dir: str, optimizer: bool, tp: int | None = None
) -> list[float]:
    import ds_engine as deepspeed

    model = build("llama", kv_heads=2, seed=7)  # other initial weights: all must come from the checkpoint
    model.train()
    engine, *_ = deepspeed.initialize(model=model, config=_config(tp or world, stage, precision))
    engine.load_checkpoint(save_dir, tag="mid", load_optimizer_states=optimizer, load_lr_scheduler_states=optimizer)
    assert engine.global_steps == FIRST
    return _steps(engine, FIRST, THEN)


@pytest.mark.timeout(900)  # five runs one after another
@pytest.mark.parametrize(("stage", "precision"), [(0, "fp32"), (2, "fp32"), (0, "bf16")])
def test_optimizer_state_moves_between_tp2_and_tp1(stage: int, precision: str, tmp_path: Path) -> None:
    tp1_dir, tp2_dir = str(tmp_path / "tp1"), str(tmp_path / "tp2")
    (tp1,) = run_ranks(1, _train_and_save, stage, precision, tp1_dir, timeout_s=180)
    tp2 = run_ranks(2, _train_and_save, stage, precision, tp2_dir, timeout_s=240)[0]
    atol = 1e-5 if precision == "fp32" else 1e-2  # bf16: the shards' matmuls round differently
    # TP=2 saved, TP=1 resumed, against the uninterrupted TP=2 run
    (at_tp1,) = run_ranks(1, _resume, stage, precision, tp2_dir, True, timeout_s=180)
    torch.testing.assert_close(torch.tensor(at_tp1), torch.tensor(tp2[FIRST:]), rtol=0, atol=atol)
    # TP=1 saved, TP=2 resumed, against the uninterrupted TP=1 run
    for losses in run_ranks(2, _resume, stage, precision, tp1_dir, True, timeout_s=240):
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(tp1[FIRST:]), rtol=0, atol=atol)
    if stage == 0 and precision == "fp32":  # the moments mattered: fresh ones give other losses
        (fresh,) = run_ranks(1, _resume, stage, precision, tp2_dir, False, timeout_s=180)
        assert max(abs(a - b) for a, b in zip(fresh[1:], tp2[FIRST + 1 :], strict=True)) > 1e-3


@pytest.mark.timeout(600)
def test_tp2_by_dp2_zero2_resumes_at_tp1_by_dp2(tmp_path: Path) -> None:
    """4 ranks (TP=2 x DP=2) saved, 2 ranks (DP=2) resumed: cut across TP, re-partitioned across DP."""
    saved = run_ranks(4, _train_and_save, 2, "fp32", str(tmp_path), 2, timeout_s=300)
    resumed = run_ranks(2, _resume, 2, "fp32", str(tmp_path), True, 1, timeout_s=240)
    for rank, losses in enumerate(resumed):  # DP rank r holds global ranks 2r, 2r+1 of the save
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(saved[2 * rank][FIRST:]), rtol=0, atol=1e-5)
