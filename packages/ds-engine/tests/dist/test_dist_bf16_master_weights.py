"""The engine with DeepSpeedExamples' bf16_master_weight/configs/bf16_full.json settings (AdamW, bf16 with
`bf16_master_weights_and_grads` and `bf16_optimizer_states`, `torch_autocast` bf16, persistence threshold 0) at
ZeRO stages 1, 2 and 3 on 2 gloo ranks.

Reference: plain PyTorch on the bf16 model, forward under torch.autocast(bf16), each rank's bf16 gradients
averaged over the ranks (summed in fp32, halved, rounded to bf16), torch.optim.AdamW (foreach=False) with bf16
parameters and moments. Tolerance: every parameter within 1 bf16 ulp (relative 2**-7) plus 1e-6 of the
reference after 4 steps. A save/load round trip through `save_checkpoint`/`load_checkpoint` resumes bit-exactly.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import NormNet
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="bf16 master weights are a ZeRO setting: needs ds-zero")

LR, WD, STEPS = 1e-2, 0.01, 4


def _config(stage: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD, "torch_adam": True}},
        "bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }


def _data(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(300 + 10 * step + rank)
    return torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def _engine(stage: int) -> Any:
    import ds_engine

    torch.manual_seed(0)
    engine, *_ = ds_engine.initialize(model=NormNet(), config=_config(stage))
    return engine


def _train(engine: Any, rank: int, steps: range) -> None:
    for step in steps:
        x, y = _data(rank, step)
        engine.backward(_loss(engine(x.bfloat16()), y))
        engine.step()


def _params(engine: Any, stage: int) -> list[torch.Tensor]:
    import ds_engine

    params = list(engine.module.parameters())
    with ds_engine.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        return [p.detach().float().clone() for p in params]


def _reference(world: int) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = NormNet().bfloat16()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD, foreach=False)
    for step in range(STEPS):
        sums = [torch.zeros_like(p, dtype=torch.float32) for p in model.parameters()]
        for r in range(world):
            model.zero_grad(set_to_none=True)
            x, y = _data(r, step)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x.bfloat16())
            _loss(out, y).backward()
            for s, p in zip(sums, model.parameters(), strict=True):
                s.add_(p.grad.float())
        for s, p in zip(sums, model.parameters(), strict=True):
            p.grad = (s / world).to(torch.bfloat16)
        opt.step()
    return [p.detach().float() for p in model.parameters()]


def _run(rank: int, world: int, stage: int, ckpt: str) -> dict[str, Any]:
    engine = _engine(stage)
    _train(engine, rank, range(2))
    engine.save_checkpoint(ckpt, tag="half")
    _train(engine, rank, range(2, STEPS))
    opt = engine.optimizer
    states = {t.dtype for st in opt.optimizer.state.values() for k, t in st.items() if k != "step"}
    resumed = _engine(stage)
    resumed.load_checkpoint(ckpt, tag="half")
    _train(resumed, rank, range(2, STEPS))
    return {
        "dtypes": states | {opt.master_weights_and_grads_dtype},
        "ours": _params(engine, stage),
        "resumed": _params(resumed, stage),
        "ref": _reference(world),
    }


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_bf16_full_config_matches_plain_pytorch_and_resumes(stage: int, tmp_path: Path) -> None:
    res = run_ranks(2, _run, stage, str(tmp_path / "ckpt"), timeout_s=180)[0]
    assert res["dtypes"] == {torch.bfloat16}
    for ours, ref, resumed in zip(res["ours"], res["ref"], res["resumed"], strict=True):
        assert bool(((ours - ref).abs() <= ref.abs() * 2.0**-7 + 1e-6).all()), float((ours - ref).abs().max())
        assert torch.equal(ours, resumed)
