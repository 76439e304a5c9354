"""The small helpers DeepSpeed's `deepspeed.comm` exports besides its collectives, so no name a script uses
is missing: launcher-env readers, cloud-environment probes, the comms-logger signature helpers, the
`timed_op` decorator and the `ProcessGroup` record.

These follow DeepSpeed 0.19.8's results for the same inputs (the tests hold literals computed with it);
they are independent of `init_distributed`, which finds the layout itself (`ds_comm._launch_env`).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch.distributed as dist

from ds_comm._comms_logger import comms_logger
from ds_comm.accelerator import get_accelerator

__all__ = [
    "ProcessGroup",
    "get_debug_log_name",
    "get_default_args",
    "get_local_rank_from_launcher",
    "get_msg_size_from_args",
    "get_tensor_kwarg",
    "get_tensor_position",
    "get_world_rank_from_launcher",
    "get_world_size_from_launcher",
    "in_aml",
    "in_aws_sm",
    "in_dlts",
    "timed_op",
]

F = TypeVar("F", bound=Callable[..., Any])

#: The parameter names torch's collectives give their payload, in the order DeepSpeed looks for them:
#: most ops, the coalesced all-reduce, the list reduce-scatter, then all_to_all and the multi-GPU ops.
_TENSOR_PARAMS = ("tensor", "tensors", "input_list", "input_tensor_list")


def _first_env(*names: str) -> str | None:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return value
    return None


def get_local_rank_from_launcher() -> int:
    """This process's rank on its node as the launcher set it: LOCAL_RANK, else OpenMPI's
    OMPI_COMM_WORLD_LOCAL_RANK, else 0 (a single-process job). A non-integer value raises ValueError."""
    return int(_first_env("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK") or 0)


def get_world_rank_from_launcher() -> int:
    """This process's global rank as the launcher set it: RANK, else OMPI_COMM_WORLD_RANK, else 0."""
    return int(_first_env("RANK", "OMPI_COMM_WORLD_RANK") or 0)


def get_world_size_from_launcher() -> int:
    """The job's size as the launcher set it: WORLD_SIZE, else OMPI_COMM_WORLD_SIZE, else 1."""
    return int(_first_env("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE") or 1)


def in_aml() -> bool:
    """Whether this runs inside Azure Machine Learning (AZUREML_EXPERIMENT_ID is set)."""
    return "AZUREML_EXPERIMENT_ID" in os.environ


def in_aws_sm() -> bool:
    """Whether this runs inside AWS SageMaker training (SM_TRAINING_ENV is set)."""
    return "SM_TRAINING_ENV" in os.environ


def in_dlts() -> bool:
    """Whether this runs on a DLTS cluster (DLTS_JOB_ID is set)."""
    return "DLTS_JOB_ID" in os.environ


def get_default_args(func: Callable[..., Any]) -> dict[str, Any]:
    """`{parameter: default}` for every parameter of `func` that has a default."""
    params = inspect.signature(func).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def get_tensor_position(func: Callable[..., Any]) -> int:
    """Index of `func`'s payload parameter (the first of tensor, tensors, input_list, input_tensor_list
    it has), -1 when it has none; torch does not name or place the payload consistently across ops."""
    names = list(inspect.signature(func).parameters)
    for candidate in _TENSOR_PARAMS:
        if candidate in names:
            return names.index(candidate)
    return -1


def get_tensor_kwarg(func: Callable[..., Any], kwargs: Mapping[str, Any]) -> Any:
    """The payload among `kwargs` laid over `func`'s defaults (first of the names above), else None."""
    merged = {**get_default_args(func), **kwargs}
    for candidate in _TENSOR_PARAMS:
        if candidate in merged:
            return merged[candidate]
    return None


def get_msg_size_from_args(func: Callable[..., Any], *args: Any, **kwargs: Any) -> int:
    """Bytes a call `func(*args, **kwargs)` carries: the payload's size, summed over a list payload
    (the total a list collective moves, not one message's), 0 when there is no payload (barrier)."""
    payload = None
    if args:
        position = get_tensor_position(func)
        if position > -1:
            payload = args[position]
    if payload is None and kwargs:
        payload = get_tensor_kwarg(func, kwargs)
    if payload is None:
        return 0
    if type(payload) is list:
        return sum(t.element_size() * t.nelement() for t in payload)
    return int(payload.element_size() * payload.nelement())


def get_debug_log_name(func_args: Mapping[str, Any], debug: bool) -> str:
    """`func_args["log_name"]`, with ` | [Caller Func: NAME]` appended when `debug`, NAME being the
    function that called the caller of this (the user's function, when called from a logging wrapper)."""
    name = str(func_args["log_name"])
    if not debug:
        return name
    return f"{name} | [Caller Func: {sys._getframe(2).f_code.co_name}]"


def _profiled(kwargs: Mapping[str, Any]) -> bool:
    config = comms_logger.config
    if not comms_logger.enabled or config is None:
        return False
    return bool(kwargs.get("prof")) or config.prof_all or kwargs.get("log_name") in config.prof_ops


def timed_op(func: F) -> F:
    """Decorate a communication function so the comms logger records its calls (DeepSpeed's `timed_op`).

    A call is recorded when the logger is enabled and the call passes `prof=True`, or `prof_all` is set, or
    its `log_name` keyword is in `prof_ops`; it is then recorded under `log_name` (the function's default
    `log_name`, or the call's), with the payload's size (`get_msg_size_from_args`) and its latency, the
    accelerator synchronised before and after. When the logger is off the cost is one check.
    """

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if not _profiled(kwargs):
            return func(*args, **kwargs)
        log_name = str({**get_default_args(func), **kwargs}.get("log_name", func.__name__))
        size = get_msg_size_from_args(func, *args, **kwargs)
        get_accelerator().synchronize()
        start = time.perf_counter()
        try:
            return func(*args, **kwargs)
        finally:
            get_accelerator().synchronize()
            world = dist.get_world_size() if dist.is_initialized() else 1
            comms_logger.record(log_name, size, time.perf_counter() - start, world, bus_op=func.__name__)

    return wrapper  # type: ignore[return-value]


class ProcessGroup:
    """DeepSpeed's plain record of a communicator: an id, its member ranks and their count.

    Not torch's `ProcessGroup` (which the collectives take as `group`); it carries no connection.
    """

    def __init__(self, comm_id: Any, ranks: list[int] | None = None) -> None:
        self.ranks: list[int] = [] if ranks is None else ranks
        self.comm_id = comm_id
        self.size = len(self.ranks)

    def __repr__(self) -> str:
        return f"ProcessGroup(comm_id={self.comm_id!r}, ranks={self.ranks!r})"
