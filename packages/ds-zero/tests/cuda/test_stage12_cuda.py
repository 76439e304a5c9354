"""Stages 1 and 2 with the model on a CUDA device (one process): flat buffers, masters and gradient
partitions on the device, or on pinned host memory with optimizer offload; results match plain torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import ds_zero

# Collected everywhere (tools/gpu_check.sh --dry-run lists them), skipped without a device.
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _model(device: str) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.Tanh(), nn.Linear(33, 5)).to(device)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_cuda_matches_plain_torch(stage: int, offload: str) -> None:
    model, ref = _model("cuda"), _model("cuda")
    config = ds_zero.ZeroConfig(stage=stage, reduce_bucket_size=200, offload_optimizer={"device": offload})
    opt = ds_zero.ZeroOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False), config=config, module=model, clip_grad=0.5
    )
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    assert opt.flats[0].flat.is_cuda
    assert opt.masters[0].is_cuda == (offload == "none")
    for step in range(5):
        x = torch.randn(8, 16, device="cuda", generator=torch.Generator("cuda").manual_seed(step))
        opt.backward(model(x).pow(2).mean())
        opt.step()
        ref(x).pow(2).mean().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
