"""DeepSpeed's small `deepspeed.utils` / `deepspeed.runtime.utils` helpers at their paths, with their semantics."""

from __future__ import annotations

import importlib
import statistics

import pytest
import torch

import ds_comm


def test_pin_memory_tracker_is_ds_comms() -> None:
    from ds_engine.utils import pin_memory_tracker

    assert pin_memory_tracker._tracker is ds_comm.pinned_memory_tracker
    pin_memory_tracker._tracker.reset()
    try:
        pin_memory_tracker.track_pinned_memory(torch.zeros(8, dtype=torch.float64).nbytes)
        assert (pin_memory_tracker._tracker._bytes, pin_memory_tracker._tracker._calls) == (64, 1)
        assert pin_memory_tracker._fmt_bytes(2048) == "2.0 KB"
    finally:
        pin_memory_tracker._tracker.reset()


def test_comms_logging_is_ds_comms_logger() -> None:
    from ds_engine.utils.comms_logging import CommsLogger, comms_logger

    assert CommsLogger is ds_comm.CommsLogger and comms_logger is ds_comm.comms_logger
    log = CommsLogger()
    log.start_profiling_comms()
    assert log.prof_all is True
    log.stop_profiling_comms()
    assert log.prof_all is False


@pytest.mark.parametrize("trim", [0.0, 0.1, 0.2, 0.4])
def test_trim_mean_matches_a_sorted_slice_mean(trim: float) -> None:
    from ds_engine.utils.timer import trim_mean

    data = [float(x) for x in torch.randn(20, generator=torch.Generator().manual_seed(0)).tolist()]
    before = list(data)
    cut = round(len(data) * trim)
    expected = statistics.fmean(sorted(data)[cut : len(data) - cut])
    assert trim_mean(data, trim) == pytest.approx(expected, rel=1e-12)
    assert data == before  # not sorted in place
    assert trim_mean([], trim) == 0
    with pytest.raises(ValueError, match="trim_percent"):
        trim_mean(data, 1.5)


def test_required_torch_version() -> None:
    from ds_engine.utils.torch import required_torch_version

    major_minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert required_torch_version(min_version=2.1)
    assert required_torch_version(min_version=major_minor, max_version=major_minor + ".999")
    assert not required_torch_version(min_version=99)
    assert not required_torch_version(max_version="2.0")
    with pytest.raises(ValueError, match="min_version or a max_version"):
        required_torch_version()


def test_register_grad_hook_sees_the_accumulated_gradient() -> None:
    from ds_engine.utils.torch import register_grad_hook

    weight = torch.nn.Parameter(torch.ones(3))
    seen: list[torch.Tensor] = []
    register_grad_hook(weight, lambda p: seen.append(p.grad.clone()))
    (weight * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    torch.testing.assert_close(seen[0], torch.tensor([1.0, 2.0, 3.0]))


def test_utils_submodules_resolve_as_attributes() -> None:
    import ds_engine.utils as utils

    for name in ("comms_logging", "nvtx", "pin_memory_tracker", "timer", "torch"):
        assert getattr(utils, name) is importlib.import_module(f"ds_engine.utils.{name}")


def test_partition_helpers_are_ds_pipes() -> None:
    pytest.importorskip("ds_pipe")
    import ds_pipe
    from ds_engine.runtime import utils

    assert utils.partition_balanced is ds_pipe.partition_balanced
    assert utils.partition_uniform(10, 4) == [0, 3, 6, 8, 10]
    parts = utils.partition_balanced([1, 1, 1, 1, 0, 1], 4)
    sums = [sum([1, 1, 1, 1, 0, 1][a:b]) for a, b in zip(parts[:-1], parts[1:], strict=True)]
    assert max(sums) - min(sums) == 1


def test_zero_to_fp32_and_groups_names() -> None:
    pytest.importorskip("ds_zero")
    pytest.importorskip("ds_parallel")
    from ds_engine.utils import groups, zero_to_fp32

    assert callable(zero_to_fp32.get_optim_files) and callable(zero_to_fp32.get_model_state_files)
    ep, edp = groups._get_expert_parallel_ranks(world_size=8, tensor_parallel_size_=2, expert_parallel_size_=2)
    assert ep == [[0, 2], [4, 6], [1, 3], [5, 7]] and edp == [[0, 4], [2, 6], [1, 5], [3, 7]]
