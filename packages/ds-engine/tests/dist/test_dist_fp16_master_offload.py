"""`fp16.fp16_master_weights_and_grads` through the engine: fp16 training at ZeRO 2 and 3 with the optimizer
offloaded to the CPU (2 gloo ranks).

Checked: the engine builds DeepSpeedCPUAdam over fp16 masters with fp32 moments (what the key means in
DeepSpeed), `explain` says so, the run trains like the same job with fp32 masters (losses within 2% at every
step: fp16 rounding of the masters is the only difference), and a checkpoint taken mid-run resumes to the
uninterrupted run's losses exactly.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import batches, loss_fn, tiny_net

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="fp16 master weights are a ZeRO setting: needs ds-zero")

STEPS, SPLIT = 6, 3


def _config(stage: int, fp16_masters: bool) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "fp16": {"enabled": True, "loss_scale": 128, "fp16_master_weights_and_grads": fp16_masters},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}},
    }


def _engine(stage: int, fp16_masters: bool) -> Any:
    import ds_engine

    engine, *_ = ds_engine.initialize(model=tiny_net(0), config=copy.deepcopy(_config(stage, fp16_masters)))
    return engine


def _train(engine: Any, data: list[tuple[torch.Tensor, torch.Tensor]]) -> list[float]:
    losses = []
    for x, y in data:
        loss = loss_fn(engine(x.half()), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return losses


def _run(rank: int, world: int, root: str, stage: int) -> dict[str, Any]:
    from ds_engine.config import DeepSpeedConfig
    from ds_engine.explain import explain

    data = batches(STEPS, 4, seed=10 + rank)
    engine = _engine(stage, True)
    base = engine.optimizer.optimizer
    out: dict[str, Any] = {
        "class": type(base).__name__,
        "masters": sorted({str(p.dtype) for g in base.param_groups for p in g["params"]}),
        "explain": explain(DeepSpeedConfig(_config(stage, True), world_size=world), device_type="cpu"),
        "losses": _train(engine, data),
    }
    out["moments"] = sorted({str(t.dtype) for st in base.state.values() for k, t in st.items() if k != "step"})
    out["fp32_masters"] = _train(_engine(stage, False), data)
    first = _engine(stage, True)
    _train(first, data[:SPLIT])
    first.save_checkpoint(root, tag=f"z{stage}")
    second = _engine(stage, True)
    second.load_checkpoint(root, tag=f"z{stage}")
    out["resumed"] = _train(second, data[SPLIT:])
    return out


@pytest.mark.parametrize("stage", [2, 3])
def test_fp16_masters_train_like_fp32_masters_and_resume_exactly(tmp_path: Path, stage: int) -> None:
    for rank, r in enumerate(run_ranks(2, _run, str(tmp_path), stage, timeout_s=300)):
        where = f"stage {stage} rank {rank}"
        assert r["class"] == "DeepSpeedCPUAdam" and r["masters"] == ["torch.float16"], where
        assert r["moments"] == ["torch.float32"], where
        assert "master weights and gradient partitions in fp16 on the CPU" in r["explain"], r["explain"]
        for step, (ours, ref) in enumerate(zip(r["losses"], r["fp32_masters"], strict=True)):
            assert abs(ours - ref) <= 0.02 * abs(ref), (where, step, ours, ref)
        assert r["resumed"] == r["losses"][SPLIT:], where
