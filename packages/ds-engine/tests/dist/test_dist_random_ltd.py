"""Random-LTD on 2 data-parallel ranks: one schedule for the job, replicas that stay identical.

Each rank trains the same tiny token model on its own batches with random-LTD dropping tokens in two of
its three layers. The kept length and the consumed layer-tokens (counted over the global batch,
2 ranks x micro 2 x 2 accumulation steps) must agree on both ranks, and the gradient all-reduce keeps
the weights equal although each rank drew its own token subsets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_comm.testing import run_ranks

HIDDEN, SEQ = 8, 8


class Mix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Mix() for _ in range(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return nn.functional.mse_loss(x, y)


def _train(rank: int, world: int) -> dict[str, Any]:
    import ds_engine
    from ds_engine.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd

    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "data_efficiency": {
            "data_routing": {
                "random_ltd": {
                    "enabled": True,
                    "total_layer_num": 3,
                    "random_ltd_layer_num": 2,
                    "random_ltd_layer_id": [1, 2],
                    "model_mask_name": None,
                    "model_type": "decoder",
                    "hidden_state_order": "batch_seq_dim",
                    "random_ltd_schedule": {
                        "min_value": 4,
                        "max_value": SEQ,
                        "schedule_type": "fixed_linear",
                        "schedule_config": {"require_steps": 3, "seq_per_step": 2},
                    },
                }
            }
        },
    }
    torch.manual_seed(0)
    engine, *_ = ds_engine.initialize(model=Net(), config=config)
    engine = convert_to_random_ltd(engine, Mix)
    torch.manual_seed(10 + rank)  # each rank draws its own token subsets
    g = torch.Generator().manual_seed(100 + rank)
    kept = []
    for _ in range(8):
        x, y = torch.randn(2, SEQ, HIDDEN, generator=g), torch.randn(2, SEQ, HIDDEN, generator=g)
        loss = engine(x, y)
        kept.append(engine.random_ltd_scheduler.get_current_seq())
        engine.backward(loss)
        engine.step()
    return {
        "kept": kept,
        "state": engine.random_ltd_scheduler.state_dict(),
        "params": torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()]),
        "global_batch": engine.random_ltd_config()["global_batch_size"],
    }


def test_two_ranks_share_the_schedule_and_stay_identical() -> None:
    r0, r1 = run_ranks(2, _train, timeout_s=180)
    assert r0["kept"] == r1["kept"] == [4, 4, 4, 4, 6, 6, 8, 8]
    assert r0["global_batch"] == 8
    assert r0["state"] == r1["state"]
    assert r0["state"]["consumed_layer_tokens"] == sum(8 * (k * 2 + SEQ) for k in (4, 4, 6, 8))
    assert torch.equal(r0["params"], r1["params"])
