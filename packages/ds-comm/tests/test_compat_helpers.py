"""DeepSpeed 0.19.8's `deepspeed.comm` helpers (launcher env, env probes, logger signature helpers,
`timed_op`, `ProcessGroup`, env patchers, backend entry points) give DeepSpeed's results in ds.

Every expected literal below was computed once by running the same calls on DeepSpeed 0.19.8
(/work/dsref, DS_ACCELERATOR=cpu); the test does not compute them from ds's code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import ds_comm
import ds_comm._compat_backend as compat_backend
from ds_comm import comms_logger

_LAUNCH_VARS = (
    "LOCAL_RANK",
    "RANK",
    "WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "NCCL_SOCKET_IFNAME",
    "AZ_BATCHAI_MPI_MASTER_NODE",
    "AZ_BATCH_MASTER_NODE",
)


def f_tensor(
    tensor: Any,
    src: int = 0,
    group: Any = None,
    async_op: bool = False,
    prof: bool = False,
    log_name: str = "bcast",
    debug: Any = None,
) -> Any:
    return tensor


def f_tensors(tensors: Any, op: Any = None, group: Any = None, log_name: str = "coal") -> Any:
    return tensors


def f_input_list(output: Any, input_list: Any, op: Any = None, group: Any = None) -> Any:
    return output


def f_itl(output_tensor_list: Any, input_tensor_list: Any, group: Any = None, async_op: bool = False) -> Any:
    return output_tensor_list


def f_none(group: Any = None, async_op: bool = False, log_name: str = "barrier") -> Any:
    return None


def f_both(x: Any, tensors: Any, tensor: Any = None) -> Any:
    return x


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_tensor_position_and_default_args_match_deepspeed() -> None:
    # DeepSpeed 0.19.8: get_tensor_position / get_default_args of the functions above.
    assert [ds_comm.get_tensor_position(f) for f in (f_tensor, f_tensors, f_input_list, f_itl, f_none, f_both)] == [
        0,
        0,
        1,
        1,
        -1,
        2,
    ]
    assert ds_comm.get_default_args(f_tensor) == {
        "src": 0,
        "group": None,
        "async_op": False,
        "prof": False,
        "log_name": "bcast",
        "debug": None,
    }
    assert ds_comm.get_default_args(f_input_list) == {"op": None, "group": None}
    assert ds_comm.get_default_args(f_both) == {"tensor": None}


def test_msg_size_and_tensor_kwarg_match_deepspeed() -> None:
    t = torch.ones(3, 4, dtype=torch.float16)
    u = torch.ones(5, dtype=torch.float64)
    sizes = [
        ds_comm.get_msg_size_from_args(f_tensor, t),
        ds_comm.get_msg_size_from_args(f_tensor, tensor=t),
        ds_comm.get_msg_size_from_args(f_tensors, [t, u]),
        ds_comm.get_msg_size_from_args(f_input_list, u, [t, u]),
        ds_comm.get_msg_size_from_args(f_itl, output_tensor_list=[u], input_tensor_list=[t, t]),
        ds_comm.get_msg_size_from_args(f_none),
        ds_comm.get_msg_size_from_args(f_none, group=None),
        ds_comm.get_msg_size_from_args(f_both, 1, [t], u),
        ds_comm.get_msg_size_from_args(f_tensor, None, tensor=u),
    ]
    assert sizes == [24, 24, 64, 64, 48, 0, 0, 40, 40]  # DeepSpeed 0.19.8
    # DeepSpeed indexes args at the payload's position without a bound check: IndexError there too.
    with pytest.raises(IndexError):
        ds_comm.get_msg_size_from_args(f_itl, [u], input_tensor_list=[t, t])
    assert ds_comm.get_tensor_kwarg(f_none, {}) is None
    assert ds_comm.get_tensor_kwarg(f_both, {}) is None
    assert ds_comm.get_tensor_kwarg(f_itl, {"input_tensor_list": 7}) == 7


def _user_fn() -> str:
    return _helper()


def _helper() -> str:
    return ds_comm.get_debug_log_name({"log_name": "x"}, True)


def test_debug_log_name_names_the_callers_caller() -> None:
    assert ds_comm.get_debug_log_name({"log_name": "all_reduce"}, False) == "all_reduce"
    assert _user_fn() == "x | [Caller Func: _user_fn]"  # DeepSpeed: "x | [Caller Func: user_fn]" for its names
    with pytest.raises(KeyError):
        ds_comm.get_debug_log_name({}, False)


@pytest.mark.parametrize(
    ("env", "expected"),
    [  # (local rank, world rank, world size) from DeepSpeed 0.19.8's *_from_launcher
        ({}, (0, 0, 1)),
        ({"LOCAL_RANK": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "5"}, (3, 0, 1)),
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "5", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "12"}, (5, 9, 12)),
        ({"RANK": "2", "WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "9", "OMPI_COMM_WORLD_SIZE": "12"}, (0, 2, 4)),
    ],
)
def test_launcher_readers_match_deepspeed(
    clean_env: pytest.MonkeyPatch, env: dict[str, str], expected: tuple[int, int, int]
) -> None:
    for name, value in env.items():
        clean_env.setenv(name, value)
    got = (
        ds_comm.get_local_rank_from_launcher(),
        ds_comm.get_world_rank_from_launcher(),
        ds_comm.get_world_size_from_launcher(),
    )
    assert got == expected


def test_launcher_reader_rejects_a_non_integer(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("RANK", "two")
    with pytest.raises(ValueError, match="two"):
        ds_comm.get_world_rank_from_launcher()


def test_environment_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AZUREML_EXPERIMENT_ID", "SM_TRAINING_ENV", "DLTS_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    assert (ds_comm.in_aml(), ds_comm.in_aws_sm(), ds_comm.in_dlts()) == (False, False, False)
    monkeypatch.setenv("AZUREML_EXPERIMENT_ID", "")
    monkeypatch.setenv("DLTS_JOB_ID", "7")
    assert (ds_comm.in_aml(), ds_comm.in_aws_sm(), ds_comm.in_dlts()) == (True, False, True)
    monkeypatch.setenv("SM_TRAINING_ENV", "{}")
    assert ds_comm.in_aws_sm() is True


def test_process_group_record() -> None:
    pg = ds_comm.ProcessGroup(7, [0, 2, 4])
    assert (pg.comm_id, pg.ranks, pg.size) == (7, [0, 2, 4], 3)
    assert ds_comm.ProcessGroup(1).size == 0
    assert ds_comm.ProcessGroup(1).ranks is not ds_comm.ProcessGroup(2).ranks  # no shared mutable default


_KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "NCCL_SOCKET_IFNAME")
_OMPI = {
    "OMPI_COMM_WORLD_RANK": "3",
    "OMPI_COMM_WORLD_SIZE": "8",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "NCCL_SOCKET_IFNAME": "eth0",
}


@pytest.mark.parametrize(
    ("extra", "expected"),
    [  # the env DeepSpeed 0.19.8's patch_aml_env_for_torch_nccl_backend(verbose=False) leaves
        (
            {"OMPI_COMM_WORLD_LOCAL_SIZE": "8", "AZ_BATCHAI_MPI_MASTER_NODE": "10.0.0.5"},
            ("3", "8", "1", "10.0.0.5", "54965", "^docker0,lo"),
        ),
        (
            {"OMPI_COMM_WORLD_LOCAL_SIZE": "4", "AZ_BATCH_MASTER_NODE": "10.0.0.7:6000"},
            ("3", "8", "1", "10.0.0.7", "6105", "^docker0,lo"),
        ),
    ],
)
def test_aml_patch_matches_deepspeed(
    clean_env: pytest.MonkeyPatch, extra: dict[str, str], expected: tuple[str, ...]
) -> None:
    for name, value in {**_OMPI, **extra}.items():
        clean_env.setenv(name, value)
    ds_comm.patch_aml_env_for_torch_nccl_backend(verbose=True)
    assert tuple(os.environ.get(k) for k in _KEYS) == expected


def test_sagemaker_patch_matches_deepspeed_and_missing_vars_are_named(clean_env: pytest.MonkeyPatch) -> None:
    for name, value in {**_OMPI, "MASTER_ADDR": "h", "MASTER_PORT": "1"}.items():
        clean_env.setenv(name, value)
    ds_comm.patch_aws_sm_env_for_torch_nccl_backend(verbose=True)
    assert tuple(os.environ.get(k) for k in _KEYS) == ("3", "8", "1", "h", "1", "eth0")  # DeepSpeed 0.19.8
    clean_env.delenv("OMPI_COMM_WORLD_LOCAL_RANK")
    with pytest.raises(KeyError, match="patch_aws_sm_env_for_torch_nccl_backend.*OMPI_COMM_WORLD_LOCAL_RANK"):
        ds_comm.patch_aws_sm_env_for_torch_nccl_backend(verbose=False)


def test_mpi_discovery_without_mpi4py_names_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import fails as if not installed
    with pytest.raises(ImportError, match="mpi4py"):
        ds_comm.mpi_discovery()


def test_backend_classes_name_the_replacement() -> None:
    with pytest.raises(NotImplementedError, match=r"TorchBackend.*init_distributed"):
        ds_comm.TorchBackend("gloo", None, None)
    with pytest.raises(NotImplementedError, match=r"CCLBackend.*init_distributed\(dist_backend='ccl'\)"):
        ds_comm.CCLBackend()


def test_init_deepspeed_backend_maps_ccl_onto_init_distributed(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(compat_backend, "init_distributed", lambda **kw: calls.append(kw))
    ds_comm.init_deepspeed_backend("gloo", None, None)  # DeepSpeed has no native gloo backend either
    ds_comm.set_backend()
    assert calls == []
    ds_comm.init_deepspeed_backend("ccl", None, "env://")
    assert calls == [{"dist_backend": "ccl", "timeout": None, "init_method": "env://"}]


def test_collectives_before_init_name_the_function() -> None:
    if ds_comm.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    t = torch.zeros(2)
    for fn, call in (
        ("allgather_fn", lambda: ds_comm.allgather_fn(t, t)),
        ("reduce_scatter_fn", lambda: ds_comm.reduce_scatter_fn(t, t)),
        ("all_gather_coalesced", lambda: ds_comm.all_gather_coalesced([t], [t])),
        ("enable_symm_mem_for_group", lambda: ds_comm.enable_symm_mem_for_group("0")),
    ):
        with pytest.raises(ds_comm.UsageError, match=f"{fn}.*init_distributed"):
            call()
    with pytest.raises(ValueError, match="all_gather_coalesced: 1 output tensors for 2 input"):
        ds_comm.all_gather_coalesced([t], [t, t])


@pytest.fixture
def logger_on() -> Iterator[None]:
    saved = (comms_logger.config, comms_logger.enabled, comms_logger.comms_dict)
    comms_logger.comms_dict = {}
    ds_comm.configure(enabled=True, prof_all=False, prof_ops=["mine"])
    try:
        yield
    finally:
        comms_logger.config, comms_logger.enabled = saved[0], saved[1]
        comms_logger.comms_dict = saved[2]


@ds_comm.timed_op
def _send_like(tensor: torch.Tensor, prof: bool = False, log_name: str = "send_like") -> torch.Tensor:
    return tensor * 2


def test_timed_op_records_what_deepspeed_would(logger_on: None) -> None:
    t = torch.ones(4, dtype=torch.float32)
    torch.testing.assert_close(_send_like(t), t * 2)  # prof_all off, default name not in prof_ops: no record
    assert comms_logger.comms_dict == {}
    _send_like(t, prof=True)
    _send_like(t, log_name="mine")
    _send_like(tensor=torch.ones(3, dtype=torch.float64), log_name="mine")
    assert _send_like.__name__ == "_send_like"
    records = comms_logger.comms_dict
    assert set(records) == {"send_like", "mine"}
    assert records["send_like"][16][0] == 1
    assert sorted(records["mine"]) == [16, 24] and records["mine"][24][0] == 1
    assert all(lat > 0 for lat in records["mine"][16][1])
