"""ZeRO-3 leaf modules on 2 ranks: a mixture-of-experts block whose expert choice differs per rank.

Rank 0's data routes to expert 0, rank 1's to expert 1. Without leaf marking each rank gathers a
different expert: ds fails with `GatherDivergenceError` naming both (the first iteration's gathers are
fingerprinted). With the block flagged as a leaf (by class through `set_z3_leaf_modules`, or by the
`zero_optimization.leaf_module` section), the whole block is gathered on entry and training matches
plain PyTorch on the same data (gradients averaged over the two ranks' batches) to 1e-6.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_zero
from ds_comm.testing import run_ranks

DIM = 16
CFG = {"stage": 3, "param_persistence_threshold": 0, "reduce_bucket_size": 200, "prefetch_bucket_size": 100}


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 2 * DIM)
        self.down = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    """Routes the whole batch to one expert, chosen from the data (the sign of its mean)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, 1)
        self.experts = nn.ModuleList([Expert(), Expert()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = int(x.mean() > 0)
        return x + torch.sigmoid(self.gate(x)) * self.experts[choice](x)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = MoE()
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(x))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.rand(8, DIM, generator=g) + 0.1
    x = -x if rank == 0 else x  # rank 0's batches route to expert 0, rank 1's to expert 1
    return x, torch.randint(0, 4, (8,), generator=g)


def _reference(model: nn.Module, steps: int, lr: float) -> list[list[float]]:
    """Plain torch on one process: each step averages the two ranks' gradients. Losses per step per rank."""
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    out = []
    for step in range(steps):
        opt.zero_grad()
        losses = []
        for rank in range(2):
            x, y = _batch(rank, step)
            loss = F.cross_entropy(model(x), y)
            (loss / 2).backward()
            losses.append(loss.item())
        opt.step()
        out.append(losses)
    return out


def _train(rank: int, world: int, how: str, steps: int = 4, lr: float = 1e-2) -> dict[str, Any]:
    torch.manual_seed(0)
    model = Net()
    reference = _reference(copy.deepcopy(model), steps, lr)
    config = dict(CFG)
    if how == "by_class":
        flagged = ds_zero.set_z3_leaf_modules(model, [MoE])
        assert flagged == [model.moe]
    elif how == "by_config":
        config["leaf_module"] = {"classes": [], "name_suffixes": ["moe"]}
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.Adam(model.parameters(), lr=lr), config=config)
    losses = []
    for step in range(steps):
        x, y = _batch(rank, step)
        loss = F.cross_entropy(model(x), y)
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {
        "losses": losses,
        "reference": [r[rank] for r in reference],
        "leaves": [type(m).__name__ for m in ds_zero.get_z3_leaf_modules(model)],
        "leaf_params": sum(ds_zero.z3_leaf_parameter(p) for p in model.parameters()),
    }


@pytest.mark.parametrize("how", ["by_class", "by_config"])
def test_leaf_moe_matches_plain_torch(how: str) -> None:
    results = run_ranks(2, _train, how, timeout_s=120)
    for rank, result in enumerate(results):
        assert result["leaves"] == ["MoE"]
        assert result["leaf_params"] == 10  # gate (2) + two experts (4 each)
        torch.testing.assert_close(result["losses"], result["reference"], rtol=0, atol=1e-6, msg=f"rank {rank}")


def test_without_leaf_the_ranks_diverge_with_an_error_naming_both_experts() -> None:
    with pytest.raises(ds_zero.GatherDivergenceError) as info:
        run_ranks(2, _train, "none", timeout_s=120)
    text = str(info.value)
    assert "moe.experts.0" in text and "moe.experts.1" in text
