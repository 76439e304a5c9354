"""`training_data` is sampled as DeepSpeed samples it, so a loss curve can be reproduced across the two.

DeepSpeed's engine wraps `training_data` in a `DistributedSampler` over the data-parallel ranks with its
defaults (shuffled, seed 0, the same order every epoch); its PipelineEngine reads `training_data` in order
(a `DistributedSampler` without shuffle). Each rank's sequence of micro-batches is checked against those
samplers built by hand on the same dataset.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DistributedSampler, TensorDataset

from ds_comm.testing import run_ranks

NUM_SAMPLES, MICRO, D = 24, 2, 4


def _dataset() -> TensorDataset:
    # The first column holds the sample's index, so a batch says which samples it holds.
    x = torch.arange(NUM_SAMPLES, dtype=torch.float32)[:, None].repeat(1, D)
    return TensorDataset(x, torch.zeros(NUM_SAMPLES, D))


def _config() -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }


def _indices_per_batch(loader: Any, num_batches: int) -> list[list[int]]:
    batches = []
    for _, (x, _y) in zip(range(num_batches), loader, strict=False):
        batches.append([int(v) for v in x[:, 0]])
    return batches


def _expected(rank: int, world: int, *, shuffle: bool) -> list[list[int]]:
    order = list(DistributedSampler(_dataset(), num_replicas=world, rank=rank, shuffle=shuffle))
    return [order[i : i + MICRO] for i in range(0, len(order), MICRO)]


def _engine_order(rank: int, world: int) -> dict[str, list[list[int]]]:
    import ds_engine

    engine, _, loader, _ = ds_engine.initialize(model=nn.Linear(D, D), config=_config(), training_data=_dataset())
    epoch = NUM_SAMPLES // (MICRO * world)
    return {"first": _indices_per_batch(loader, epoch), "second": _indices_per_batch(loader, epoch)}


def _pipeline_order(rank: int, world: int) -> list[list[int]]:
    import ds_engine
    from ds_pipe import LayerSpec, PipeDataParallelTopology, PipelineModule

    module = PipelineModule(
        [LayerSpec(nn.Linear, D, D)],
        topology=PipeDataParallelTopology(num_pp=1, num_dp=world),
        loss_fn=F.mse_loss,
    )
    engine, _, loader, _ = ds_engine.initialize(model=module, config=_config(), training_data=_dataset())
    assert loader is engine.training_dataloader
    return _indices_per_batch(loader, NUM_SAMPLES // (MICRO * world))


@pytest.mark.timeout(120)
def test_engine_shuffles_training_data_as_deepspeed_does() -> None:
    results = run_ranks(2, _engine_order, timeout_s=90)
    for rank, result in enumerate(results):
        expected = _expected(rank, 2, shuffle=True)
        assert result["first"] == expected
        assert result["second"] == expected  # no set_epoch: the same order again, as in DeepSpeed
        assert expected != _expected(rank, 2, shuffle=False)  # the check can tell the two apart


@pytest.mark.timeout(120)
def test_pipeline_engine_reads_training_data_in_order() -> None:
    pytest.importorskip("ds_pipe")
    results = run_ranks(2, _pipeline_order, timeout_s=90)
    for rank, batches in enumerate(results):
        assert batches == _expected(rank, 2, shuffle=False)
