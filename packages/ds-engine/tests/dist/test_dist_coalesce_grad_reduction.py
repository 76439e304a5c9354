"""`engine.coalesce_grad_reduction()` on 2 gloo ranks, ZeRO stages 0-3: several backwards per step, one reduction.

Each step runs its backwards inside the block (the last marked as the boundary) and steps after it. The
weights must match plain PyTorch (one process, every rank's chunks, AdamW on the mean over ranks of the
summed chunk gradients) and the engine without the block; at stages 2 and 3, which reduce during backward,
the block must issue fewer reductions than the same backwards outside it.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")

STEPS, CHUNKS, WORLD = 2, 3, 2


def _chunks(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return batches(STEPS * CHUNKS, 4, seed=40 + rank)


def _reference() -> torch.Tensor:
    """Plain PyTorch: the gradient of each step is the mean over ranks of the sum over that rank's chunks."""
    model = tiny_net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = [_chunks(r) for r in range(WORLD)]
    for step in range(STEPS):
        loss = sum(loss_fn(model(x), y) for r in range(WORLD) for x, y in data[r][step * CHUNKS : (step + 1) * CHUNKS])
        (loss / WORLD).backward()
        opt.step()
        opt.zero_grad()
    return flat_params(model)


@contextlib.contextmanager
def _counting(counts: list[int], engine: Any) -> Any:
    """Append the number of reductions issued inside: the collectives (ds_comm's comms logger counts every
    call) and stage 2's buckets reduced through pair memory, which are not collectives (two ranks of one
    host: ds_zero._stage12.pair_memory)."""
    import ds_comm

    ds_comm.configure(enabled=True, prof_all=True)
    ds_comm.comms_logger.comms_dict = {}
    before = _pair_launches(engine)
    try:
        yield
    finally:
        collectives = sum(r[0] for sizes in ds_comm.comms_logger.comms_dict.values() for r in sizes.values())
        counts.append(collectives + _pair_launches(engine) - before)
        ds_comm.configure(enabled=False)


def _pair_launches(engine: Any) -> int:
    pairs = getattr(getattr(engine.optimizer, "_grads", None), "pairs", None) or []
    return sum(p.launched for p in pairs if p is not None)


def _train(rank: int, stage: int, coalesce: bool) -> tuple[torch.Tensor, int]:
    import ds_engine

    with ds_engine.zero.Init() if stage == 3 else contextlib.nullcontext():
        model = tiny_net(0)
    engine = make_engine(model, base_config(zero_optimization={"stage": stage, "reduce_bucket_size": 100}))
    data = _chunks(rank)
    counts: list[int] = []
    for step in range(STEPS):
        block = engine.coalesce_grad_reduction() if coalesce else contextlib.nullcontext()
        with _counting(counts, engine), block:
            for i, (x, y) in enumerate(data[step * CHUNKS : (step + 1) * CHUNKS]):
                engine.set_gradient_accumulation_boundary(i == CHUNKS - 1)
                engine.backward(loss_fn(engine(x), y))
        engine.step()
    with ds_engine.zero.GatheredParameters(list(model.parameters())) if stage == 3 else contextlib.nullcontext():
        weights = flat_params(model).clone()
    return weights, sum(counts)


def _both(rank: int, world: int, stage: int) -> dict[str, tuple[torch.Tensor, int]]:
    return {"plain": _train(rank, stage, False), "coalesced": _train(rank, stage, True)}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_coalesced_step_matches_torch_and_the_uncoalesced_engine(stage: int) -> None:
    results = run_ranks(WORLD, _both, stage=stage, timeout_s=180)
    reference = _reference()
    for rank, result in enumerate(results):
        ours, _ = result["coalesced"]
        plain, _ = result["plain"]
        torch.testing.assert_close(ours, reference, rtol=1e-5, atol=1e-6, msg=f"rank {rank} vs torch")
        torch.testing.assert_close(ours, plain, rtol=1e-5, atol=1e-6, msg=f"rank {rank} vs no block")
    if stage >= 2:  # these stages reduce at every backward without the block
        for result in results:
            assert 0 < result["coalesced"][1] < result["plain"][1], result
