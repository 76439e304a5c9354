"""Tiny ZenFlow training runs, written against DeepSpeed's API so that DeepSpeed 0.19.8 and ds run the same code.

`train(ds, rank, world, name)` takes the `deepspeed` module to use (`deepspeed` itself or `ds_engine`),
builds a seeded fp32 two-layer MLP, trains it with `ds.initialize` and the ZenFlow config of `RUNS[name]`
(CPU optimizer offload, top-k column selection) on per-rank data, and returns this rank's per-step losses
and the trained weights' norms. `data/record_zenflow_deepspeed.py` runs every case under DeepSpeed and
writes `data/zenflow_deepspeed.json`; `test_zenflow_deepspeed_reference.py` runs them under ds and compares.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

D_IN, D_HIDDEN, D_OUT, BATCH, STEPS, LR = 16, 24, 8, 4, 12, 0.01

#: name -> (world size, zero stage, zenflow section)
RUNS: dict[str, tuple[int, int, dict[str, Any]]] = {
    "z2_w1": (1, 2, {"topk_ratio": 0.25, "select_strategy": "step", "select_interval": 4, "update_interval": 2}),
    "z2_w2_warmup": (
        2,
        2,
        {
            "topk_ratio": 0.25,
            "select_strategy": "step",
            "select_interval": 4,
            "update_interval": 2,
            "full_warm_up_rounds": 3,
        },
    ),
    "z1_w2": (2, 1, {"topk_ratio": 0.3, "select_strategy": "step", "select_interval": 3, "update_interval": 3}),
    "z2_w1_overlap": (
        1,
        2,
        {
            "topk_ratio": 0.25,
            "select_strategy": "step",
            "select_interval": 4,
            "update_interval": 2,
            "full_warm_up_rounds": 1,
            "overlap_step": True,
        },
    ),
    "z2_w2_overlap": (
        2,
        2,
        {
            "topk_ratio": 0.25,
            "select_strategy": "step",
            "select_interval": 4,
            "update_interval": 2,
            "overlap_step": True,
        },
    ),
}

#: ZeRO-3 runs ds makes (DeepSpeed 0.19.8's ZeRO-3 ZenFlow needs CUDA, so the recorder skips them): each
#: is ds's stage-2 run of the same name with stage 3, compared with it in `dist/test_dist_zenflow.py`.
STAGE3_RUNS: dict[str, tuple[int, int, dict[str, Any]]] = {
    "z3_w1": (1, 3, RUNS["z2_w1"][2]),
    "z3_w1_warmup": (1, 3, dict(RUNS["z2_w2_warmup"][2])),
    "z2_w1_warmup": (1, 2, dict(RUNS["z2_w2_warmup"][2])),
}


class Net(nn.Module):
    """x -> fc1 -> tanh -> fc2, without biases.

    No 1-D parameters: DeepSpeed 0.19.8 ranks a weight's columns from the wrong stretch of its reduction
    bucket when 1-D parameters precede it there (its column ranking skips them without advancing its
    bucket offset), so only a model of matrices gets DeepSpeed's intended selection. ds's selection with
    1-D parameters is checked against a plain-PyTorch reference in ds-zero's tests.
    """

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HIDDEN, bias=False)
        self.fc2 = nn.Linear(D_HIDDEN, D_OUT, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def build() -> Net:
    torch.manual_seed(1234)
    return Net()


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)) for _ in range(STEPS)]


def config(world: int, stage: int, zenflow: dict[str, Any]) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": BATCH * world,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "offload_optimizer": {"device": "cpu"}, "zenflow": dict(zenflow)},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1000,
    }


def train(ds: ModuleType, rank: int, world: int, name: str) -> dict[str, Any]:
    """This rank's per-step losses and the trained parameters' norms."""
    run_world, stage, zenflow = RUNS[name] if name in RUNS else STAGE3_RUNS[name]
    assert run_world == world, (name, world)
    model = build()
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config(world, stage, zenflow))
    losses = []
    for x, y in batches(rank):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    optimizer = engine.optimizer
    wait = getattr(optimizer, "wait_last_update_and_copy", None)
    norms = {n: float(p.detach().float().norm()) for n, p in engine.module.named_parameters()}
    result = {"losses": losses, "norms": norms, "optimizer": type(optimizer).__name__}
    destroy = getattr(engine, "destroy", None)
    if destroy is not None and wait is None:
        destroy()
    return result
