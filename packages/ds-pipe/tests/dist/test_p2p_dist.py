"""p2p between stages on gloo: static-shape errors, dynamic shapes, and tensor-parallel partitioned transfers."""

from __future__ import annotations

from typing import Any

import pipe_models
import pytest
import torch
from torch import nn

from ds_comm import _shm_p2p as ds_comm_shm_p2p
from ds_comm.testing import run_ranks
from ds_pipe import (
    ActivationShapeError,
    LayerSpec,
    PipelineExecutor,
    PipelineModule,
    PipeModelDataParallelTopology,
    checkpointing,
)


def _rows_batches(rows: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(r, 4, generator=g), torch.randn(r, 2, generator=g)) for r in rows]


def _mlp_module(stages: int, dynamic: bool) -> PipelineModule:
    layers = [LayerSpec(nn.Linear, 4, 6), nn.Tanh(), LayerSpec(nn.Linear, 6, 2)]
    return PipelineModule(
        layers,
        num_stages=stages,
        loss_fn=nn.functional.mse_loss,
        seed_layers=True,
        partition_method=[0, 2, 3] if stages == 2 else "uniform",
        dynamic_shape=dynamic,
    )


def _shapes(rank: int, world_size: int, dynamic: bool, rows: list[int]) -> dict[str, Any]:
    module = _mlp_module(world_size, dynamic)
    executor = PipelineExecutor(module, micro_batches=len(rows))
    loss = executor.train_batch(iter(_rows_batches(rows)))
    evaluated = executor.eval_batch(iter(_rows_batches(rows)), reduce_output=None)
    grads = {n: p.grad for n, p in module.named_parameters()}
    return {"loss": loss, "eval": evaluated, "grads": grads, "shared_memory": executor.p2p.shared_memory}


def _sequential(rows: list[int]) -> tuple[torch.Tensor, list[torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(1234)
    first = nn.Linear(4, 6)
    torch.manual_seed(1236)
    last = nn.Linear(6, 2)
    losses = [nn.functional.mse_loss(last(torch.tanh(first(x))), y) for x, y in _rows_batches(rows)]
    (sum(losses) / len(losses)).backward()
    grads = {
        "0.weight": first.weight.grad,
        "0.bias": first.bias.grad,
        "2.weight": last.weight.grad,
        "2.bias": last.bias.grad,
    }
    return torch.stack(losses).mean().detach(), [loss.detach() for loss in losses], grads


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_dynamic_shapes_match_sequential(shm: str) -> None:
    """Over either transport between the stages (`DS_COMM_SHM`: ds_comm's shared-memory p2p ring or gloo)."""
    rows = [3, 5, 5, 2]
    results = run_ranks(2, _shapes, dynamic=True, rows=rows, timeout_s=90, env={"DS_COMM_SHM": shm})
    loss, per_micro, grads = _sequential(rows)
    assert [res["shared_memory"] for res in results] == [{1: shm == "1"}, {0: shm == "1"}]
    for res in results:
        torch.testing.assert_close(res["loss"], loss, rtol=0, atol=1e-6)
        torch.testing.assert_close(torch.stack(res["eval"]), torch.stack(per_micro), rtol=0, atol=1e-6)
        for name, grad in res["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=0, atol=1e-6)


def _prefetch_choices(rank: int, world_size: int) -> dict[str, bool]:
    executor = PipelineExecutor(_mlp_module(world_size, dynamic=False), micro_batches=2)
    p2p, peer = executor.p2p, 1 - rank
    slot = ds_comm_shm_p2p.SLOT_BYTES
    return {
        "small": p2p._prefetches([((32, 32), torch.float32)], peer, partitioned=False),
        "one slot": p2p._prefetches([((slot // 2,), torch.bfloat16)], peer, partitioned=False),
        "one over": p2p._prefetches([((32, 32), torch.float32), ((slot + 1,), torch.uint8)], peer, partitioned=False),
    }


@pytest.mark.parametrize("shm", ["1", "0"], ids=["shared-memory", "gloo"])
def test_receives_are_posted_early_only_for_gloo(shm: str) -> None:
    """[Note: no prefetch through the ring]: early posting is for messages gloo carries."""
    for res in run_ranks(2, _prefetch_choices, timeout_s=60, env={"DS_COMM_SHM": shm}):
        over_gloo = shm == "0"
        assert res == {"small": over_gloo, "one slot": over_gloo, "one over": True}


def test_static_shapes_reject_a_changed_activation() -> None:
    message = r"changed from float32\[3, 6\] to float32\[5, 6\].*dynamic_shape=True"
    with pytest.raises(ActivationShapeError, match=message):
        run_ranks(2, _shapes, dynamic=False, rows=[3, 5], timeout_s=60, collective_timeout_s=20)


def _partitioned(rank: int, world_size: int, partitioned: bool) -> dict[str, Any]:
    """2 stages x 2 tensor-parallel ranks holding replicated layers (as TP inputs/outputs are)."""
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=1)
    module = PipelineModule(
        pipe_models.specs(p_drop=0.0),
        topology=topo,
        loss_fn=pipe_models.loss_fn,
        seed_layers=True,
        base_seed=pipe_models.BASE_SEED,
        partition_method="uniform",
        activation_checkpoint_interval=1 if partitioned else 0,
    )
    checkpointing.configure(module.mpu(), partition_activations=partitioned)
    executor = PipelineExecutor(module, micro_batches=3, pipe_partitioned=partitioned, grad_partitioned=partitioned)
    data = iter([pipe_models.micro_batch(0, 0, k) for k in range(3)])
    loss = executor.train_batch(data)
    flags = (executor.p2p.pipe_partitioned, executor.p2p.grad_partitioned, checkpointing._state.policy.partition_world)
    checkpointing.reset()
    return {"loss": loss, "grads": {n: p.grad.clone() for n, p in module.named_parameters()}, "flags": flags}


def test_partitioned_transfers_and_checkpoints_match_sequential() -> None:
    results = run_ranks(4, _partitioned, partitioned=True, timeout_s=120)
    ref = pipe_models.reference_run(pipe_models.specs(p_drop=0.0), micro_batches=3, replicas=1, steps=1, lr=0.0)
    for rank, res in enumerate(results):
        assert res["flags"] == (True, True, 2), f"rank {rank} did not partition"
        torch.testing.assert_close(res["loss"], ref["losses"][0], rtol=0, atol=1e-6)
        for name, grad in res["grads"].items():
            torch.testing.assert_close(grad, ref["grads"][name], rtol=0, atol=1e-6, msg=f"{name} rank {rank}")
