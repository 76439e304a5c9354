"""The released-storage pool: a released full storage's bytes go to the next gather of the same size.

Single process. The pool's own moves and bounds; a parameter released and another of the same size gathered
get the same memory and each its own values; a storage held elsewhere is never pooled; training at stage 3
gives the same losses and weights with the pool as without it, and the gathers were served from it.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ds_zero
from ds_zero import GatheredParameters
from ds_zero._params import partitioned_param
from ds_zero._params.partitioned_param import state_of
from ds_zero._params.storage_pool import MIN_POOLED_BYTES, ReleasedStoragePool

MIB = 2**20
pytestmark = pytest.mark.skipif(
    not hasattr(torch.UntypedStorage, "_swap_data_ptr_"), reason="this torch cannot move a storage's bytes"
)


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch) -> ReleasedStoragePool:
    """A fresh pool in place of the process's, so the tests neither see nor leave pooled blocks."""
    fresh = ReleasedStoragePool()
    monkeypatch.setattr(partitioned_param, "released_storages", fresh)
    return fresh


def _storage(nbytes: int, fill: int) -> torch.UntypedStorage:
    t = torch.full((nbytes,), fill, dtype=torch.uint8)
    return t.untyped_storage()


def test_take_and_fill_move_the_bytes_not_copy_them() -> None:
    pool = ReleasedStoragePool(capacity=64 * MIB)
    a = _storage(16 * MIB, 7)
    ptr = a.data_ptr()
    assert pool.take_from(a)
    assert a.nbytes() == 0 and pool.pooled_bytes == 16 * MIB
    b = torch.UntypedStorage(0)
    assert not pool.fill(b, 8 * MIB)  # no block of that size
    assert pool.fill(b, 16 * MIB)
    assert b.nbytes() == 16 * MIB and b.data_ptr() == ptr and pool.pooled_bytes == 0 and pool.hits == 1
    view = torch.empty(0, dtype=torch.uint8).set_(b, 0, (16 * MIB,))
    assert int(view[0]) == int(view[-1]) == 7  # the same memory: what was there is still there
    assert not pool.fill(torch.UntypedStorage(0), 16 * MIB)  # taken once only


def test_bounds_small_blocks_capacity_oldest_first_and_clear() -> None:
    pool = ReleasedStoragePool()
    assert not pool.take_from(_storage(16 * MIB, 1))  # capacity 0 until a coordinator reserves
    pool.reserve(40 * MIB)
    pool.reserve(8 * MIB)  # never lowered
    assert pool.capacity == 40 * MIB
    small = _storage(MIN_POOLED_BYTES - 1, 1)
    assert not pool.take_from(small) and small.nbytes() == MIN_POOLED_BYTES - 1  # left to the allocator
    assert not pool.take_from(_storage(48 * MIB, 1))  # larger than the whole pool
    first, second, third = _storage(16 * MIB, 1), _storage(16 * MIB, 2), _storage(12 * MIB, 3)
    first_ptr, second_ptr = first.data_ptr(), second.data_ptr()
    for s in (first, second, third):
        assert pool.take_from(s)
    assert pool.pooled_bytes == 28 * MIB  # 44 MiB offered: the oldest 16 MiB block was freed
    out = torch.UntypedStorage(0)
    assert pool.fill(out, 16 * MIB) and out.data_ptr() == second_ptr != first_ptr
    pool.clear()
    assert pool.pooled_bytes == 0 and not pool.fill(torch.UntypedStorage(0), 12 * MIB)


def test_a_released_parameter_memory_serves_the_next_gather_with_its_own_values(pool: ReleasedStoragePool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False))  # 16 MiB each
    want = [m.weight.detach().clone() for m in model]
    ds_zero.partition_model(model)
    pool.reserve(32 * MIB)
    w0, w1 = model[0].weight, model[1].weight
    with GatheredParameters(w0):
        ptr = w0.data_ptr()
        assert torch.equal(w0, want[0])
    assert state_of(w0).full_flat.untyped_storage().nbytes() == 0 and pool.pooled_bytes == 16 * MIB
    with GatheredParameters(w1):
        assert w1.data_ptr() == ptr and pool.hits == 1  # w0's pages, no new allocation
        assert torch.equal(w1, want[1])
    with GatheredParameters(w0):
        assert torch.equal(w0, want[0])


def test_a_storage_another_tensor_holds_is_never_pooled(pool: ReleasedStoragePool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 2048, bias=False), nn.Linear(2048, 2048, bias=False))
    want = model[0].weight.detach().clone()
    ds_zero.partition_model(model)
    pool.reserve(32 * MIB)
    with GatheredParameters(model[0].weight):
        kept = model[0].weight.data
    assert pool.pooled_bytes == 0  # left to `kept`
    with GatheredParameters(model[1].weight):
        model[1].weight.data.fill_(0.25)  # a gather into fresh memory: `kept` is not overwritten
    assert torch.equal(kept, want)


def _train(model: nn.Module, steps: int = 4) -> list[float]:
    torch.manual_seed(3)
    base = torch.optim.Adam(model.parameters(), lr=1e-3)
    config = {"stage": 3, "stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 2 * 2048 * 2048}
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=config)
    losses = []
    for _ in range(steps):
        x = torch.randn(4, 2048)
        loss = torch.tanh(model(x)).pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _tower() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(4)))


def test_training_is_the_same_with_and_without_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    without = ReleasedStoragePool()
    monkeypatch.setattr(ReleasedStoragePool, "reserve", lambda self, nbytes: None)  # stays at capacity 0
    monkeypatch.setattr(partitioned_param, "released_storages", without)
    model_a = _tower()
    losses_a = _train(model_a)
    assert without.hits == 0
    monkeypatch.undo()

    pooled = ReleasedStoragePool()
    monkeypatch.setattr(partitioned_param, "released_storages", pooled)
    monkeypatch.setattr("ds_zero._schedule.coordinator.released_storages", pooled)
    model_b = _tower()
    losses_b = _train(model_b)
    assert pooled.hits > 0  # the forward and backward gathers reused released layers' memory
    assert losses_a == losses_b
    with GatheredParameters(list(model_a.parameters()) + list(model_b.parameters())):
        for pa, pb in zip(model_a.parameters(), model_b.parameters(), strict=True):
            assert torch.equal(pa, pb)


def test_a_consumed_gradient_goes_to_the_pool_unless_another_tensor_holds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_zero._stage3 import grads

    fresh = ReleasedStoragePool(capacity=64 * MIB)
    monkeypatch.setattr(grads, "released_storages", fresh)
    grad = torch.full((2048, 2048), 0.5)
    assert grads._recycle_gradient(grad, grad.reshape(-1))
    assert grad.untyped_storage().nbytes() == 0 and fresh.pooled_bytes == 16 * MIB
    grad = torch.full((2048, 2048), 0.5)
    kept = grad[0]  # a hook kept a view
    assert not grads._recycle_gradient(grad, grad.reshape(-1))
    assert fresh.pooled_bytes == 16 * MIB and bool((kept == 0.5).all())


def test_one_rank_weight_gradients_are_computed_into_recycled_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    from ds_zero._construct import linear
    from ds_zero._stage3 import grads

    pooled = ReleasedStoragePool()
    for module in (partitioned_param, linear, grads):
        monkeypatch.setattr(module, "released_storages", pooled)
    monkeypatch.setattr("ds_zero._schedule.coordinator.released_storages", pooled)
    recycled: list[bool] = []
    real = grads._recycle_gradient
    monkeypatch.setattr(grads, "_recycle_gradient", lambda g, piece: recycled.append(real(g, piece)) or recycled[-1])
    computed_into_pool = []
    real_empty = pooled.empty
    monkeypatch.setattr(pooled, "empty", lambda *a: computed_into_pool.append(real_empty(*a)) or computed_into_pool[-1])
    with ds_zero.Init():  # the stage-3 linear: its weight gradient asks the pool for memory
        model = _tower()
    reference = _tower()
    losses = _train(model)
    assert recycled.count(True) >= 4 * len(losses)  # every weight's gradient went back after it was added
    assert any(out is not None for out in computed_into_pool)  # and later gradients were computed into them
    base = torch.optim.Adam(reference.parameters(), lr=1e-3)
    torch.manual_seed(3)
    for want in losses:  # the same training in plain torch
        loss = torch.tanh(reference(torch.randn(4, 2048))).pow(2).mean()
        loss.backward()
        base.step()
        base.zero_grad()
        assert loss.item() == pytest.approx(want, rel=1e-5)
