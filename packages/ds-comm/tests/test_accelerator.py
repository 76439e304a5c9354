"""Accelerator selection and the CPU implementation's figures."""

from __future__ import annotations

import pytest
import torch

from ds_comm import accelerator as acc


@pytest.fixture(autouse=True)
def _fresh_accelerator(monkeypatch: pytest.MonkeyPatch):
    acc.set_accelerator(None)
    yield
    acc.set_accelerator(None)


def test_cpu_is_chosen_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    a = acc.get_accelerator()
    assert a.name == "cpu"
    assert a.communication_backend_name() == "gloo"
    assert a.device() == torch.device("cpu")


def test_env_forces_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "CPU")
    assert acc.get_accelerator().name == "cpu"


def test_unknown_accelerator_lists_valid_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "tpu")
    with pytest.raises(ValueError, match=r"DS_ACCELERATOR='tpu' is not a known accelerator; valid values: cpu, cuda"):
        acc.get_accelerator()


def test_cuda_requested_without_device_is_clear(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="no cuda device is available"):
        acc.get_accelerator()


def test_choice_is_fixed_after_first_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    first = acc.get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "bogus")
    assert acc.get_accelerator() is first


def test_cpu_memory_stats_follow_rss() -> None:
    a = acc.CpuAccelerator()
    before = a.memory_allocated()
    block = torch.ones(64 * 1024 * 1024 // 4)  # 64 MiB, touched
    after = a.memory_allocated()
    assert after - before >= 48 * 1024 * 1024
    assert a.max_memory_allocated() >= after
    stats = a.memory_stats()
    assert stats["total_bytes"] > stats["allocated_bytes"] > 0
    del block


def test_cpu_dtypes_and_seed() -> None:
    a = acc.CpuAccelerator()
    assert a.supported_dtypes() == [torch.float32, torch.float16, torch.bfloat16]
    a.manual_seed(3)
    x = torch.rand(3)
    a.manual_seed(3)
    assert torch.equal(x, torch.rand(3))
    t = torch.ones(2)
    assert a.pin_memory(t) is t and not a.is_pinned(t)
