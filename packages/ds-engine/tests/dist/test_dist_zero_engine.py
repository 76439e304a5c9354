"""ZeRO through the engine: stages 1, 2 and 3 (under zero.Init) from the config give stage 0's losses and weights.

Needs ds-zero (the `ds-engine[all]` session); skipped where it is not installed.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")


class TiedLM(nn.Module):
    """Embedding tied to the output head, large enough that stage 3 really partitions it."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 64)
        self.body = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 50, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.emb(idx)))
        return nn.functional.cross_entropy(logits.reshape(-1, 50), target.reshape(-1))


def _train(rank: int, world: int, stage: int, gas: int) -> dict[str, object]:
    import ds_engine as deepspeed

    torch.manual_seed(0)
    with deepspeed.zero.Init() if stage == 3 else contextlib.nullcontext():
        model = TiedLM()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": gas,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "gradient_clipping": 0.5,
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 1000,
            "allgather_bucket_size": 1000,
        },
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    data = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 50, (6 * gas, world, 2, 5), generator=data)
    losses = []
    for micro in range(6 * gas):
        loss = engine(idx[micro, rank], (idx[micro, rank] + 1) % 50)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    with (
        deepspeed.zero.GatheredParameters(list(engine.module.parameters())) if stage == 3 else contextlib.nullcontext()
    ):
        weights = torch.cat([p.detach().reshape(-1).clone() for p in engine.module.parameters()])
    return {"losses": torch.tensor(losses), "weights": weights, "steps": engine.global_steps}


@pytest.mark.parametrize("gas", [2])
def test_zero_stages_match_stage0_through_initialize(gas: int) -> None:
    reference = run_ranks(2, _train, stage=0, gas=gas, timeout_s=120)
    for stage in (1, 2, 3):
        ours = run_ranks(2, _train, stage=stage, gas=gas, timeout_s=120)
        for rank in range(2):
            assert ours[rank]["steps"] == reference[rank]["steps"] == 6
            torch.testing.assert_close(
                ours[rank]["losses"],
                reference[rank]["losses"],
                rtol=1e-5,
                atol=1e-6,
                msg=f"stage {stage} rank {rank} losses",
            )
            torch.testing.assert_close(
                ours[rank]["weights"],
                reference[rank]["weights"],
                rtol=1e-5,
                atol=1e-6,
                msg=f"stage {stage} rank {rank} weights",
            )
