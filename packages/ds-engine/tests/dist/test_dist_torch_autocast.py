"""`torch_autocast` on 2 gloo ranks: ZeRO 0/1/2/3 training under bf16 and fp16 autocast ends with the weights
of a plain-PyTorch run (torch.autocast forward, gradients averaged over both ranks' batches, AdamW)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import pytest
import torch
from ds_engine_testkit import NormNet
from torch import nn

from ds_comm.testing import run_ranks

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _data(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(200 + rank)
    return [(torch.randn(4, 8, generator=g), torch.randn(4, 4, generator=g)) for _ in range(3)]


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out.float(), y)


def _run(rank: int, world: int, stage: int, dtype: str) -> dict[str, Any]:
    import ds_engine

    torch.manual_seed(0)
    model = NormNet()
    reference = copy.deepcopy(model)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "torch_autocast": {"enabled": True, "dtype": dtype},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    for x, y in _data(rank):
        engine.backward(_loss(engine(x), y))
        engine.step()
    params = list(engine.module.parameters())
    with ds_engine.zero.GatheredParameters(params) if stage == 3 else contextlib.nullcontext():
        ours = [p.detach().clone() for p in params]
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step_batches in zip(*(_data(r) for r in range(world)), strict=True):
        opt.zero_grad()
        for x, y in step_batches:
            with torch.autocast("cpu", dtype=_DTYPES[dtype]):
                out = reference(x)
            (_loss(out, y) / world).backward()
        opt.step()
    return {"ours": ours, "ref": [p.detach().clone() for p in reference.parameters()]}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_autocast_training_matches_torch_on_two_ranks(stage: int) -> None:
    if stage > 0:
        pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")
    for dtype in ("bf16", "fp16"):
        results = run_ranks(2, _run, stage=stage, dtype=dtype, timeout_s=180)
        for result in results:
            for ours, ref in zip(result["ours"], result["ref"], strict=True):
                # fp32 reductions of identical fp32 gradients: only summation order differs.
                torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6, msg=f"stage {stage}, {dtype}")
