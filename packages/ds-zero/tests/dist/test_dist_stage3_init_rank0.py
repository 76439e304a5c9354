"""`ds_zero.Init` partitions rank 0's values, as DeepSpeed's does, on 2 ranks whose initialisations differ.

Each rank seeds its RNG with its own rank, and writes rank-dependent values in `__init__` (DeepSpeed's test
pattern: initialise on rank 0 only). Whatever each rank built, the gathered parameters must equal what rank 0
built in plain torch (no stitching of rank 0's first half and rank 1's second half); the same for `Init(module=)`
over a model built outside the context, and for a quantized initialisation (every rank quantizes rank 0's
values). A module built on the meta device by `torch.nn.utils.skip_init` (alone, or with children) is
partitioned once `to_empty()` gives it storage: its values are uninitialised, but the same bits on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.utils import skip_init

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


class Sub(nn.Module):
    def __init__(self, n: int, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(n, n, device=device)
        self.more = nn.ModuleList([nn.Linear(n, 3, device=device)])


class SkipInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.alone = skip_init(nn.Linear, 5, 7)
        self.nested = skip_init(Sub, 5)
        self.plain = nn.Linear(5, 2)


def _skip_init_bits() -> dict[str, torch.Tensor]:
    with ds_zero.Init():
        model = SkipInit()
    assert all(p.ds_tensor.numel() == -(-p.numel() // 2) for p in model.parameters())
    return {n: p.view(torch.int32).clone() for n, p in _gathered(model).items()}


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
        "skip_init": _skip_init_bits(),
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
        assert sorted(r["skip_init"]) == sorted(n for n, _ in SkipInit().named_parameters())
        for name, bits in r["skip_init"].items():
            assert torch.equal(bits, results[0]["skip_init"][name]), (rank, name)
