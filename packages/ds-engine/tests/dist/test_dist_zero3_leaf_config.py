"""`zero_optimization.leaf_module` through `initialize()`: a per-rank MoE routing trains as plain PyTorch.

Rank 0's batches route to expert 0, rank 1's to expert 1. The config names the MoE block by suffix, so
ZeRO-3 gathers it whole on entry; the losses equal a plain torch reference on both ranks' data to 1e-6.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO-3 needs ds-zero: pip install 'ds-engine[zero]'")


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(12, 12) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts[int(x.mean() > 0)](x)  # data-dependent routing


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE()
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7 * step + rank)
    x = torch.rand(5, 12, generator=g) + 0.1
    return (-x if rank == 0 else x), torch.randint(0, 3, (5,), generator=g)


def _train(rank: int, world: int) -> dict[str, Any]:
    import ds_engine as deepspeed

    torch.manual_seed(0)
    model = Net()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    config = {
        "train_micro_batch_size_per_gpu": 5,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            "leaf_module": {"name_suffixes": ["moe"]},
        },
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    losses, ref_losses = [], []
    for step in range(3):
        loss = F.cross_entropy(engine(_batch(rank, step)[0]), _batch(rank, step)[1])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        ref_opt.zero_grad()
        for r in range(world):
            rl = F.cross_entropy(ref(_batch(r, step)[0]), _batch(r, step)[1])
            (rl / world).backward()
            if r == rank:
                ref_losses.append(rl.item())
        ref_opt.step()
    from ds_engine.utils import get_z3_leaf_modules

    return {"losses": losses, "ref": ref_losses, "leaves": [type(m).__name__ for m in get_z3_leaf_modules(model)]}


def test_leaf_module_section_makes_per_rank_routing_train() -> None:
    for r in run_ranks(2, _train, timeout_s=120):
        assert r["leaves"] == ["MoE"]
        torch.testing.assert_close(r["losses"], r["ref"], rtol=0, atol=1e-6)
