"""The DeepSpeed accelerator methods on a real CUDA device: streams, events, graphs, rng, memory, constructors."""

from __future__ import annotations

import pytest
import torch

from ds_comm.accelerator import CudaAccelerator

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_streams_events_and_graph_replay() -> None:
    cuda = CudaAccelerator()
    assert not cuda.is_synchronized_device() and not cuda.use_host_timers()
    side = cuda.Stream()
    x = torch.ones(1024, device="cuda")
    with cuda.stream(side):
        y = x * 2
    done = cuda.Event()
    done.record(side)
    done.synchronize()
    assert cuda.current_stream() == cuda.default_stream()
    torch.testing.assert_close(y, torch.full_like(x, 2.0))
    static_in, graph = torch.zeros(8, device="cuda"), cuda.create_graph()
    warm = torch.cuda.Stream()
    with torch.cuda.stream(warm):
        static_out = static_in + 1  # warm-up outside capture, as CUDA graphs require
    torch.cuda.current_stream().wait_stream(warm)
    with cuda.capture_to_graph(graph):
        static_out = static_in + 1
    static_in.fill_(41.0)
    cuda.replay_graph(graph)
    torch.testing.assert_close(static_out, torch.full((8,), 42.0, device="cuda"))


def test_rng_memory_and_constructors() -> None:
    cuda = CudaAccelerator()
    cuda.manual_seed(7)
    state = cuda.get_rng_state()
    first = torch.rand(4, device="cuda")
    cuda.set_rng_state(state)
    torch.testing.assert_close(torch.rand(4, device="cuda"), first)
    assert cuda.default_generator(cuda.current_device()).initial_seed() == 7
    blob = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    assert cuda.memory_reserved() >= blob.nbytes and cuda.memory_cached() == cuda.memory_reserved()
    assert 0 < cuda.available_memory() < cuda.total_memory()
    assert "allocated_bytes.all.current" in cuda.memory_stats()
    del blob
    cuda.empty_cache()
    t = cuda.HalfTensor([1.0, 2.0])
    assert t.dtype == torch.float16 and cuda.on_accelerator(t) and cuda.current_device_name().startswith("cuda:")
    cuda.range_push("ds_comm::probe")
    cuda.range_pop()
    assert cuda.lazy_call(lambda: None) is None
