"""Activation checkpointing inside a 2-stage pipeline on gloo: bit-identical gradients to none, dropout included.

`seed_layers` is off here, so dropout draws from each stage's global generator: identical
gradients prove that `checkpoint` restores the RNG state for recomputation and leaves the stream
of later micro-batches untouched.
"""

from __future__ import annotations

from typing import Any

import pipe_models
import torch

from ds_comm.testing import run_ranks
from ds_pipe import PipelineExecutor, PipelineModule, checkpointing


def _grads_with_interval(
    interval: int, cpu_checkpointing: bool, stream: int = 100
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    checkpointing.configure(None, checkpoint_in_cpu=cpu_checkpointing)
    rank = torch.distributed.get_rank()
    torch.manual_seed(0)
    module = PipelineModule(
        pipe_models.specs(p_drop=0.3),
        num_stages=2,
        loss_fn=pipe_models.loss_fn,
        partition_method="uniform",
        activation_checkpoint_interval=interval,
    )
    torch.manual_seed(stream + rank)  # dropout stream of this stage
    executor = PipelineExecutor(module, micro_batches=4)
    losses = []
    for step in range(2):
        data = iter([pipe_models.micro_batch(step, 0, k) for k in range(4)])
        losses.append(executor.train_batch(data))
    return losses, {n: p.grad.clone() for n, p in module.named_parameters()}


def _compare(rank: int, world_size: int) -> dict[str, Any]:
    base_losses, base = _grads_with_interval(0, False)
    out = {}
    for interval, cpu in [(1, False), (2, True), (3, False)]:
        losses, grads = _grads_with_interval(interval, cpu)
        out[(interval, cpu)] = (
            all(torch.equal(a, b) for a, b in zip(losses, base_losses, strict=True)),
            sorted(n for n in base if not torch.equal(base[n], grads[n])),
        )
    # Dropout really is active: another dropout stream changes the gradients.
    _, other = _grads_with_interval(0, False, stream=200)
    checkpointing.reset()
    return {
        "same": out,
        "grad_names": sorted(base),
        "losses": base_losses,
        "dropout_matters": any(not torch.equal(base[n], other[n]) for n in base),
    }


def test_checkpointed_pipeline_gradients_are_bit_identical() -> None:
    results = run_ranks(2, _compare, timeout_s=120)
    for rank, res in enumerate(results):
        assert res["grad_names"], f"rank {rank} owns parameters"
        for setting, (losses_equal, differing) in res["same"].items():
            assert losses_equal, f"rank {rank} {setting}: losses differ"
            assert differing == [], f"rank {rank} {setting}: gradients differ for {differing}"
        assert res["dropout_matters"], f"rank {rank}: dropout had no effect, the test would prove nothing"
    assert torch.equal(results[0]["losses"][0], results[1]["losses"][0])
