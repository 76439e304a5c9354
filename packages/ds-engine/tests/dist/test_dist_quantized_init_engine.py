"""ZeRO-Inference through the engine, 2 gloo ranks: a model built under `deepspeed.zero.Init` with the
ds_config's `weight_quantization.quantized_initialization`, then `deepspeed.initialize` (stage 3, no
optimizer), gives in `engine(...)` what a plain-PyTorch model with the dequantized weights gives.

Reference: the same model built by plain PyTorch (same seed), its `nn.Linear` weights replaced by their
dequantized values computed here (min/max per group of 4 along dimension 1, nearest of 256 codes);
float32, atol 1e-6; and within 0.02 of the unquantized model. An engine with an optimizer over the
quantized weights is refused, naming the key. Needs ds-zero (the `ds-engine[all]` session).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="quantized zero.Init needs ds-zero: pip install 'ds-engine[zero]'")

WORLD = 2
QUANT = {"num_bits": 8, "group_size": 4, "group_dim": 1, "symmetric": False}


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 3,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "weight_quantization": {"quantized_initialization": QUANT},
    }


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _inputs() -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(4))


def _rank(rank: int, world: int) -> dict[str, Any]:
    import ds_engine as deepspeed

    with deepspeed.zero.Init(config_dict_or_path=_config(), dtype=torch.float32):
        model = _model()
    engine, *_ = deepspeed.initialize(model=model, config=_config())
    with torch.no_grad():
        out = engine(_inputs())
    with deepspeed.zero.Init(config_dict_or_path=_config(), dtype=torch.float32):
        trained = _model()
    try:
        deepspeed.initialize(
            model=trained,
            config={**_config(), "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
        )
        refused = ""
    except ValueError as err:
        refused = str(err)
    return {"out": out, "refused": refused, "quantized": bool(model[0].weight.weight_quantized)}


def _dequantized(w: torch.Tensor) -> torch.Tensor:
    grouped = w.detach().reshape(w.shape[0], -1, QUANT["group_size"])
    low, high = grouped.min(-1, keepdim=True).values, grouped.max(-1, keepdim=True).values
    step = (high - low) / 255
    codes = torch.round(((grouped - low) / torch.where(step > 0, step, 1.0)).clamp(0, 255))
    return (codes * step + low).reshape(w.shape)


@pytest.mark.timeout(180)
def test_engine_forward_on_quantized_weights_matches_the_dequantized_reference() -> None:
    reference = _model()
    with torch.no_grad():
        unquantized = reference(_inputs())
        for layer in (reference[0], reference[2]):
            layer.weight.copy_(_dequantized(layer.weight))
        want = reference(_inputs())
    for rank, got in enumerate(run_ranks(WORLD, _rank, timeout_s=150)):
        assert got["quantized"]
        torch.testing.assert_close(got["out"], want, rtol=0, atol=1e-6, msg=f"rank {rank}")
        torch.testing.assert_close(got["out"], unquantized, rtol=0, atol=0.02, msg=f"rank {rank}")
        assert "weight_quantization.quantized_initialization" in got["refused"], got["refused"]
