"""StateOffloader: storages parked and restored bit for bit with every view intact, handles swapped out, errors."""

from __future__ import annotations

import pytest
import torch

from ds_ops import OffloadStateTypeEnum, StateOffloader, StatesOffloadedError
from ds_ops.host_memory import huge_page_zeros

K = OffloadStateTypeEnum


@pytest.fixture
def copying() -> object:
    StateOffloader.copy_on_same_device = True
    yield
    StateOffloader.copy_on_same_device = False


def test_copy_path_frees_storage_and_restores_every_view(copying: object) -> None:
    flat = torch.randn(10)
    param = torch.nn.Parameter(flat[:6].view(2, 3))
    master = flat[6:]  # a second view of the same storage
    moment = torch.randn(5)
    expected = (flat.clone(), moment.clone())
    off = StateOffloader()
    off.offload({K.lp_params: [flat], K.hp_params: [master], K.optim_states: [moment]}, params=[param])
    assert flat.untyped_storage().nbytes() == 0 and moment.untyped_storage().nbytes() == 0
    assert off.parked_bytes == 10 * 4 + 5 * 4  # the shared storage moved once
    assert param.shape == (2, 3) and torch.isnan(param).all()  # a placeholder, never freed memory
    assert off.offloaded == set(K)  # include=None: every kind
    off.reload()
    assert torch.equal(flat, expected[0]) and torch.equal(moment, expected[1])
    assert torch.equal(param, expected[0][:6].view(2, 3)) and param.data_ptr() == flat.data_ptr()
    param.data.add_(1)  # still a view of the flat buffer
    assert torch.equal(flat[:6], expected[0][:6] + 1)
    assert off.parked_bytes == 0 and not off.offloaded


def test_same_device_moves_nothing_but_frees_dead_gradients() -> None:
    params = torch.randn(8)
    zero_grads = torch.zeros(8)
    live_grads = torch.ones(8)
    scratch = torch.randn(4)
    p = torch.nn.Parameter(torch.randn(4))
    p.grad = scratch
    off = StateOffloader()
    off.offload(
        {
            K.lp_params: [params],
            K.lp_grads: [zero_grads, live_grads],
            K.contiguous_grad_buffer: [scratch],
        },
        params=[p],
        scratch=[scratch],
    )
    assert params.untyped_storage().nbytes() == 32 and live_grads.untyped_storage().nbytes() == 32
    assert zero_grads.untyped_storage().nbytes() == 0 and scratch.untyped_storage().nbytes() == 0
    assert p.grad is None  # a handle over freed memory is set aside
    assert off.parked_bytes == 32 + 16
    off.reload()
    assert torch.equal(zero_grads, torch.zeros(8)) and torch.equal(live_grads, torch.ones(8))
    assert p.grad is scratch and torch.equal(scratch, torch.zeros(4))  # dead contents come back as zeros


def test_include_selects_kinds_and_repeats_are_skipped(copying: object) -> None:
    a, b = torch.randn(3), torch.randn(3)
    off = StateOffloader()
    off.offload({K.optim_states: [a], K.hp_params: [b]}, include=["optim_states"])
    assert a.untyped_storage().nbytes() == 0 and b.untyped_storage().nbytes() == 12
    off.offload({K.optim_states: [a], K.hp_params: [b]}, include=[K.optim_states, K.hp_params])
    assert off.offloaded == {K.optim_states, K.hp_params} and off.parked_bytes == 24


def test_foreign_memory_stays(copying: object) -> None:
    pinned_like = huge_page_zeros(1 << 20, torch.float32)  # over an mmap: not resizable
    before = pinned_like.untyped_storage().nbytes()
    off = StateOffloader()
    off.offload({K.optim_states: [pinned_like]})
    assert pinned_like.untyped_storage().nbytes() == before > 0 and off.parked_bytes == 0


def test_device_none_does_nothing_and_nvme_is_refused() -> None:
    t = torch.zeros(4)
    off = StateOffloader()
    off.offload({K.lp_grads: [t]}, device="none")
    assert not off.offloaded and t.untyped_storage().nbytes() == 16
    with pytest.raises(ValueError, match="NVMe is not supported"):
        off.offload({}, device="nvme")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'none', got 'gpu'"):
        off.offload({}, device="gpu")
    with pytest.raises(ValueError, match="unknown state 'weights'"):
        off.offload({}, include=["weights"])


def test_check_loaded_names_the_call_and_the_states() -> None:
    off = StateOffloader()
    off.offload({}, include=[K.lp_grads, K.optim_states])
    off.check_loaded("engine.forward()", [K.lp_params])
    with pytest.raises(StatesOffloadedError, match=r"engine.step\(\) needs the training states lp_grads, optim_states"):
        off.check_loaded("engine.step()", list(K))


def test_state_devices_follow_the_bytes(copying: object) -> None:
    moment, zero_grads, empty = torch.randn(4), torch.zeros(4), torch.empty(0)
    states = {K.optim_states: [moment], K.lp_grads: [zero_grads], K.lp_params: [empty]}
    off = StateOffloader()
    assert off.state_devices(states, K.optim_states) == off.state_devices(states, "lp_grads") == {torch.device("cpu")}
    assert off.state_devices(states, K.lp_params) == set()  # no bytes anywhere
    assert off.state_devices(states, K.hp_params) == set()  # no tensors of that kind
    off.offload(states, include=[K.optim_states, K.lp_grads])
    assert off.state_devices(states, K.optim_states) == {torch.device("cpu")}  # where its copy is
    assert off.state_devices(states, K.lp_grads) == set()  # dropped as dead: comes back zero-filled
    off.reload()
    assert off.state_devices(states, K.lp_grads) == {torch.device("cpu")}
    with pytest.raises(ValueError, match="unknown state 'moments'; valid: optim_states, hp_params"):
        off.state_devices(states, "moments")
