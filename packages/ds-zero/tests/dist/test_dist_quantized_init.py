"""A model built under `ds_zero.Init` with `weight_quantization.quantized_initialization`, on 2 gloo ranks.

Reference: the same model built by plain PyTorch (same seed), whose `nn.Linear` / `nn.Embedding` weights
are replaced by their dequantized values computed here (min/max per group along `group_dim`, nearest
code). Inside `GatheredParameters`, in a stage-3 forward (`DeepSpeedZeRoOffload`), and after loading a
full-precision state_dict (quantized on load), the partitioned model's outputs equal that reference's
(float32, atol 1e-6); each dequantized weight is within half its group's step of the original, and the
outputs stay within the stated tolerance of the unquantized model (8 bits: 0.02, 4 bits: 0.25). The
quantized weights are one 1-D storage tensor each, `F.linear` / `F.embedding` are the dequantizing
wrappers over `zero3_linear_wrap` / torch's embedding, and training a quantized weight is refused.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import run_ranks

WORLD = 2
_8BIT = {"num_bits": 8, "group_size": 4, "group_dim": 1, "symmetric": False}
_4BIT = {"num_bits": 4, "group_size": 2, "group_dim": 0, "symmetric": True}


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.fc1 = nn.Linear(8, 12)
        self.fc2 = nn.Linear(12, 4)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(idx))))


def _idx() -> torch.Tensor:
    return torch.arange(16).reshape(2, 8) % 13


def _config(quantized: dict[str, Any]) -> dict[str, Any]:
    return {
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "weight_quantization": {"quantized_initialization": quantized},
    }


def _rank(rank: int, world: int, quantized: dict[str, Any]) -> dict[str, Any]:
    import ds_zero
    from ds_zero import GatheredParameters, ZeroParamStatus

    torch_embedding = F.embedding
    cfg = _config(quantized)
    torch.manual_seed(0)
    with ds_zero.Init(config_dict_or_path=cfg, dtype=torch.float32):
        model = Tiny()
    weights = [model.emb.weight, model.fc1.weight, model.fc2.weight]
    out: dict[str, Any] = {
        "wrapped": F.linear.__wrapped__ is ds_zero.zero3_linear_wrap and F.embedding.__wrapped__ is torch_embedding,
        "marked": [getattr(p, "weight_quantized", False) for p in weights]
        + [getattr(p, "weight_quantized", False) for p in (model.fc1.bias, model.fc2.bias)],
        "storage_shapes": [tuple(p.ds_shape) for p in weights],
        "released": all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters()),
    }
    with ds_zero.Init(config_dict_or_path={"zero_optimization": {"stage": 3}}):
        nn.Linear(2, 2)  # a later plain Init keeps the wrapper
    out["kept"] = F.linear.__wrapped__ is ds_zero.zero3_linear_wrap
    with torch.no_grad():
        with GatheredParameters(list(model.parameters())):
            out["gathered"] = model(_idx())
            out["gathered_shapes"] = [tuple(p.shape) for p in weights]
        offload = ds_zero.DeepSpeedZeRoOffload(model, config=cfg["zero_optimization"])
        out["stage3"] = model(_idx())
        out["released_after"] = all(p.ds_status is ZeroParamStatus.NOT_AVAILABLE for p in model.parameters())
        torch.manual_seed(1)
        model.load_state_dict(Tiny().state_dict())
        out["loaded"] = model(_idx())
    try:
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, sgd, config=cfg["zero_optimization"], parameter_offload=offload)
        out["refused"] = ""
    except ValueError as err:
        out["refused"] = str(err)
    return out


def _dequantized(w: torch.Tensor, quantized: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """(dequantized weight, per-value step) by plain PyTorch."""
    bits, group, dim = quantized["num_bits"], quantized["group_size"], quantized["group_dim"]
    moved = w.detach().movedim(dim, -1)
    grouped = moved.reshape(*moved.shape[:-1], moved.shape[-1] // group, group)
    low, high = grouped.min(-1, keepdim=True).values, grouped.max(-1, keepdim=True).values
    if quantized["symmetric"]:
        high = torch.maximum(low.abs(), high.abs())
        low = -high
    step = (high - low) / (2**bits - 1)
    codes = torch.round(((grouped - low) / torch.where(step > 0, step, 1.0)).clamp(0, 2**bits - 1))
    values = (codes * step + low).reshape(moved.shape).movedim(-1, dim)
    return values, step.expand_as(grouped).reshape(moved.shape).movedim(-1, dim)


def _reference(seed: int, quantized: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """(output with dequantized weights, output unquantized, each weight within half a step)."""
    torch.manual_seed(seed)
    model = Tiny()
    with torch.no_grad():
        plain = model(_idx())
        within = []
        for layer in (model.emb, model.fc1, model.fc2):
            values, step = _dequantized(layer.weight, quantized)
            within.append(bool(((values - layer.weight).abs() <= step / 2 + 1e-6).all()))
            layer.weight.copy_(values)
        return model(_idx()), plain, within


@pytest.mark.timeout(180)
@pytest.mark.parametrize("quantized", [_8BIT, _4BIT], ids=["8bit-asymmetric-dim1", "4bit-symmetric-dim0"])
def test_quantized_init_gathers_dequantizes_and_loads_like_the_reference(quantized: dict[str, Any]) -> None:
    want, unquantized, within = _reference(0, quantized)
    want_loaded, _, _ = _reference(1, quantized)
    assert all(within)
    tolerance = 0.02 if quantized["num_bits"] == 8 else 0.25
    for rank, got in enumerate(run_ranks(WORLD, _rank, quantized, timeout_s=150)):
        assert got["wrapped"] and got["kept"], f"rank {rank}: F.linear / F.embedding are not the wrappers"
        assert got["marked"] == [True, True, True, False, False], f"rank {rank}"
        assert all(len(shape) == 1 for shape in got["storage_shapes"]) and got["released"]
        assert got["gathered_shapes"] == got["storage_shapes"], "gathered weights come back quantized"
        for key, expected in (("gathered", want), ("stage3", want), ("loaded", want_loaded)):
            torch.testing.assert_close(got[key], expected, rtol=0, atol=1e-6, msg=f"rank {rank} {key}")
        torch.testing.assert_close(got["gathered"], unquantized, rtol=0, atol=tolerance)
        assert got["released_after"]
        assert "weight_quantization.quantized_initialization" in got["refused"]
