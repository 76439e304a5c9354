"""Pipeline numerics on gloo: 2 and 4 stages and 2 pipe x 2 data match the sequential model to 1e-6 (fp32).

The model (see pipe_models) passes tuples with an int mask between stages, ties a projection between
the first and last stage, and uses dropout: with `seed_layers=True` the masks depend only on the
layer index and the forward count, so the sequential reference reproduces them exactly.
"""

from __future__ import annotations

from typing import Any

import pipe_models
import pytest
import torch

from ds_comm.testing import run_ranks
from ds_pipe import PipeDataParallelTopology, PipelineExecutor, PipelineModule

MICRO_BATCHES, STEPS, LR = 4, 3, 0.1


def _train(rank: int, world_size: int, num_pp: int, num_dp: int) -> dict[str, Any]:
    module = PipelineModule(
        pipe_models.specs(p_drop=0.2),
        topology=PipeDataParallelTopology(num_pp, num_dp),
        loss_fn=pipe_models.loss_fn,
        seed_layers=True,
        base_seed=pipe_models.BASE_SEED,
        partition_method="uniform",
    )
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    first_grads: dict[str, torch.Tensor] = {}

    def step() -> None:
        if not first_grads:
            first_grads.update({n: p.grad.clone() for n, p in module.named_parameters()})
        opt.step()

    executor = PipelineExecutor(module, micro_batches=MICRO_BATCHES, optimizer_step=step)
    replica = module.mpu().get_data_parallel_rank()
    losses = []
    for s in range(STEPS):
        data = iter([pipe_models.micro_batch(s, replica, k) for k in range(MICRO_BATCHES)])
        losses.append(executor.train_batch(data if executor.is_first_stage or executor.is_last_stage else None))
    return {
        "losses": losses,
        "grads": first_grads,
        "parts": module.partitions(),
        "stage": module.stage_id,
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
    }


def _check_against_reference(results: list[dict[str, Any]], num_dp: int) -> None:
    ref = pipe_models.reference_run(
        pipe_models.specs(p_drop=0.2), micro_batches=MICRO_BATCHES, replicas=num_dp, steps=STEPS, lr=LR
    )
    covered = set()
    for rank, res in enumerate(results):
        for ours, theirs in zip(res["losses"], ref["losses"], strict=True):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6, msg=f"loss on rank {rank}")
        for name, grad in res["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=0, atol=1e-6, msg=f"grad {name} rank {rank}")
        for name, param in res["params"].items():
            torch.testing.assert_close(param, ref["params"][name], rtol=0, atol=1e-6, msg=f"{name} on rank {rank}")
        covered |= set(res["params"])
    assert covered == set(ref["params"]), "every parameter lives on some stage"
    # The tied projection exists on the first and last stage and stays bit-identical there.
    tied = [res["params"]["tied_modules.proj.weight"] for res in results if "tied_modules.proj.weight" in res["params"]]
    assert len(tied) == 2 * num_dp and all(torch.equal(t, tied[0]) for t in tied)


@pytest.mark.parametrize(
    ("num_pp", "num_dp", "shm"),
    [(2, 1, "1"), (4, 1, "1"), (2, 2, "1"), (4, 1, "0")],
    ids=["2x1", "4x1", "2x2", "4x1-gloo"],
)
def test_pipeline_matches_sequential(num_pp: int, num_dp: int, shm: str) -> None:
    """Neighbours talk through ds_comm's shared-memory ring, or (`DS_COMM_SHM=0`) gloo, where the next
    message's receives are posted early and the loss walks back from the last stage over gloo's p2p."""
    env = {"DS_COMM_SHM": shm}
    results = run_ranks(num_pp * num_dp, _train, num_pp=num_pp, num_dp=num_dp, timeout_s=120, env=env)
    assert results[0]["parts"] == ([0, 6, 11] if num_pp == 2 else [0, 3, 6, 9, 11])
    _check_against_reference(results, num_dp)
