"""`ds_zero.Init` partitions rank 0's values, as DeepSpeed's does, on 2 ranks whose initialisations differ.

Each rank seeds its RNG with its own rank, and writes rank-dependent values in `__init__` (DeepSpeed's test
pattern: initialise on rank 0 only). Whatever each rank built, the gathered parameters must equal what rank 0
built in plain torch (no stitching of rank 0's first half and rank 1's second half); the same for `Init(module=)`
over a model built outside the context, and for a quantized initialisation (every rank quantizes rank 0's
values).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks


class Net(nn.Module):
    def __init__(self, rank: int) -> None:
        super().__init__()
        self.a = nn.Linear(5, 7)  # 35 + 7: odd sizes, padded shards
        self.b = nn.Parameter(torch.zeros(9))
        with torch.no_grad():
            self.b.fill_(float(rank + 1))  # only rank 0's 1.0 may survive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x).sum() + self.b.sum()


def _built(rank: int) -> Net:
    torch.manual_seed(rank)
    return Net(rank)


def _gathered(model: nn.Module) -> dict[str, torch.Tensor]:
    with ds_zero.GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def _quantized_output(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer built under a quantized `Init` with each rank's own seed: its output, and rank 0's plain one."""
    cfg = {
        "zero_optimization": {"stage": 3},
        "weight_quantization": {"quantized_initialization": {"num_bits": 8, "group_size": 4, "group_dim": 1}},
    }
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    plain = nn.Linear(8, 6)(x).detach()
    torch.manual_seed(rank)
    with ds_zero.Init(config_dict_or_path=cfg, dtype=torch.float32):
        layer = nn.Linear(8, 6)
    with ds_zero.GatheredParameters(list(layer.parameters())):
        return layer(x).detach().clone(), plain


def _rank(rank: int, world: int) -> dict[str, Any]:
    reference = {n: p.detach().clone() for n, p in _built(0).named_parameters()}
    with ds_zero.Init():
        in_context = _built(rank)
    model = _built(rank)
    ds_zero.Init(module=model)
    quantized, plain = _quantized_output(rank)
    return {
        "reference": reference,
        "in_context": _gathered(in_context),
        "module_arg": _gathered(model),
        "quantized": quantized,
        "plain": plain,
    }


def test_init_partitions_rank0s_values_whatever_each_rank_built() -> None:
    results = run_ranks(2, _rank, timeout_s=120)
    for rank, r in enumerate(results):
        assert torch.equal(r["reference"]["b"], torch.ones(9))
        for case in ("in_context", "module_arg"):
            for name, want in results[0]["reference"].items():
                torch.testing.assert_close(r[case][name], want, rtol=0, atol=0, msg=f"rank {rank} {case} {name}")
        torch.testing.assert_close(r["quantized"], results[0]["quantized"], rtol=0, atol=0)
        torch.testing.assert_close(r["quantized"], r["plain"], rtol=0, atol=0.02)  # rank 0's layer, 8-bit
