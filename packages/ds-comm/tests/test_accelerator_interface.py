"""The accelerator interface DeepSpeed's code and tests call, on the CPU implementation.

The method list is DeepSpeed 0.19's `DeepSpeedAccelerator` (minus its op-builder hooks, which
belong to ds-ops); each behaviour is checked, not just the name.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_comm import accelerator as acc
from ds_comm.accelerator._numa import count_numa_devices, parse_cpulist

DEEPSPEED_METHODS = """
is_synchronized_device use_host_timers resolves_data_dependency handles_memory_backpressure device_name device
set_device current_device current_device_name device_count synchronize random set_rng_state get_rng_state
manual_seed manual_seed_all initial_seed default_generator Stream stream current_stream default_stream Event
empty_cache memory_allocated max_memory_allocated reset_max_memory_allocated memory_cached max_memory_cached
reset_max_memory_cached memory_stats reset_peak_memory_stats memory_reserved max_memory_reserved total_memory
available_memory is_bf16_supported is_fp16_supported
is_fp64_supported supported_dtypes is_available range_push range_pop lazy_call
communication_backend_name is_triton_supported create_graph capture_to_graph replay_graph BFloat16Tensor ByteTensor
DoubleTensor FloatTensor HalfTensor IntTensor LongTensor pin_memory is_pinned unpin_memory on_accelerator
pin_empty pin_empty_like register_host_memory unregister_host_memory pin_memory_alignment
export_envs visible_devices_envs set_visible_devices_envs get_compile_backend set_compile_backend
""".split()


@pytest.fixture
def cpu() -> acc.CpuAccelerator:
    return acc.CpuAccelerator()


@pytest.mark.parametrize("kind", [acc.CpuAccelerator, acc.CudaAccelerator])
def test_every_deepspeed_method_exists(kind: type) -> None:
    missing = [name for name in DEEPSPEED_METHODS if not hasattr(kind, name)]
    assert missing == []


def test_device_count_honours_local_size(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_SIZE", "3")
    assert cpu.device_count() == 3
    monkeypatch.setenv("LOCAL_SIZE", "0")  # DeepSpeed: 0 means "not set", fall back to NUMA nodes
    assert cpu.device_count() == count_numa_devices()
    monkeypatch.delenv("LOCAL_SIZE")
    assert cpu.device_count() == count_numa_devices() >= 1
    monkeypatch.setenv("LOCAL_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_SIZE='two'"):
        cpu.device_count()


def _node(root: Path, index: int, cpulist: str) -> None:
    (root / f"node{index}").mkdir()
    (root / f"node{index}" / "cpulist").write_text(cpulist + "\n")


def test_numa_count_skips_coreless_and_repeated_nodes(tmp_path: Path) -> None:
    _node(tmp_path, 0, "0-3,8")
    _node(tmp_path, 1, "4-7")
    _node(tmp_path, 2, "")  # HBM in flat mode: memory only
    _node(tmp_path, 3, "4-7")  # same cores as the previous node
    _node(tmp_path, 10, "9")  # node10 sorts after node3 by number
    assert count_numa_devices(tmp_path) == 3
    assert count_numa_devices(tmp_path / "absent") == 1
    assert parse_cpulist("0-2,5,7-8") == [0, 1, 2, 5, 7, 8]
    with pytest.raises(ValueError, match="'a-b'"):
        parse_cpulist("0,a-b")


def test_rng_state_round_trips(cpu) -> None:
    cpu.manual_seed(123)
    state = cpu.get_rng_state()
    first = torch.rand(4)
    cpu.set_rng_state(state)
    torch.testing.assert_close(torch.rand(4), first)
    assert cpu.initial_seed() == 123
    assert cpu.default_generator(0) is torch.default_generator
    assert cpu.random() is torch.random


def test_synchronous_device_answers(cpu) -> None:
    assert cpu.is_synchronized_device() and cpu.use_host_timers()
    assert cpu.resolves_data_dependency() and cpu.handles_memory_backpressure()
    assert cpu.Stream is None and cpu.Event is None and cpu.current_stream() is None and cpu.create_graph() is None
    with cpu.stream(None), cpu.capture_to_graph(None):
        pass
    assert cpu.lazy_call(lambda: 7) == 7
    assert cpu.current_device_name() == "cpu"
    assert cpu.on_accelerator(torch.zeros(1)) and not cpu.is_triton_supported()


def test_memory_figures(cpu) -> None:
    blob = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert cpu.memory_reserved() == pytest.approx(cpu.memory_allocated(), rel=0.05)
    assert cpu.memory_cached() >= blob.nbytes
    assert cpu.max_memory_cached() >= cpu.memory_cached() * 0.95
    assert 0 < cpu.available_memory() <= cpu.total_memory()
    stats = cpu.memory_stats()
    assert stats["allocated_bytes.all.peak"] >= stats["allocated_bytes.all.current"] * 0.95 > 0
    cpu.reset_max_memory_allocated()
    cpu.reset_max_memory_cached()
    cpu.empty_cache()
    del blob


def test_typed_constructors_make_cpu_tensors_of_that_dtype(cpu) -> None:
    made = {
        torch.bfloat16: cpu.BFloat16Tensor([1.5]),
        torch.uint8: cpu.ByteTensor([3]),
        torch.float64: cpu.DoubleTensor([1.5]),
        torch.float32: cpu.FloatTensor([1.5]),
        torch.float16: cpu.HalfTensor([1.5]),
        torch.int32: cpu.IntTensor([3]),
        torch.int64: cpu.LongTensor([3]),
    }
    for dtype, tensor in made.items():
        assert tensor.dtype == dtype and tensor.device.type == "cpu"
    assert cpu.FloatTensor(3).shape == (3,)  # the legacy constructor: a size, as DeepSpeed's cpu one


def test_unpin_is_a_no_op_with_the_torch_backend(cpu, monkeypatch) -> None:
    monkeypatch.delenv("DS_PIN_MEMORY_BACKEND", raising=False)
    t = torch.arange(4.0)
    assert cpu.unpin_memory(t) is None
    assert torch.equal(t, torch.arange(4.0))


def test_visible_devices_and_envs(cpu) -> None:
    env: dict[str, str] = {}
    cpu.set_visible_devices_envs(env, [0, 2])
    assert env == {"CUDA_VISIBLE_DEVICES": "0,2"}
    assert cpu.export_envs() == [] and acc.CudaAccelerator().export_envs() == ["NCCL"]


def test_compile_backend(cpu) -> None:
    assert cpu.get_compile_backend() == "inductor"
    cpu.set_compile_backend("eager")
    assert cpu.get_compile_backend() == "eager"
    with pytest.raises(ValueError, match="'no_such_backend'"):
        cpu.set_compile_backend("no_such_backend")


def test_is_current_accelerator_supported() -> None:
    import ds_comm

    acc.set_accelerator(acc.CpuAccelerator())
    try:
        assert ds_comm.is_current_accelerator_supported() is True

        class Other(acc.CpuAccelerator):
            def device_name(self, device_index: int | None = None) -> str:
                return "tpu"

        acc.set_accelerator(Other())
        assert acc.is_current_accelerator_supported() is False
    finally:
        acc.set_accelerator(None)
