"""The engine on one CUDA device: fused AdamW against plain torch, and fp16/bf16 training (skipped without a GPU)."""

from __future__ import annotations

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_fp32_on_cuda_uses_fused_adamw_and_matches_torch() -> None:
    cfg = base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}})
    model = tiny_net(0)
    engine = make_engine(model, cfg)
    assert engine.device.type == "cuda" and model.l1.weight.is_cuda
    assert engine.optimizer.defaults.get("fused") is True
    ref = tiny_net(0).cuda()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, fused=True)
    for x, y in batches(8, 4):
        x, y = x.cuda(), y.cuda()
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        ref_opt.zero_grad()
        loss_fn(ref(x), y).backward()
        ref_opt.step()
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_on_cuda_trains(precision: str) -> None:
    torch.manual_seed(0)
    teacher = torch.randn(8, 4, device="cuda")
    model = tiny_net(0)
    engine = make_engine(
        model, base_config(**{precision: {"enabled": True}}, optimizer={"type": "Adam", "params": {"lr": 1e-2}})
    )
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    assert model.l1.weight.dtype == dtype and model.buf.dtype == torch.float32
    losses = []
    for _ in range(60):
        x = torch.randn(4, 8, device="cuda")
        loss = loss_fn(engine(x.to(dtype)), x @ teacher)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert sum(losses[-5:]) < sum(losses[:5]) / 4
    assert engine.skipped_steps < 10  # fp16: only while the dynamic scale searches down from 2**16
