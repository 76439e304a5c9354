"""`deepspeed.utils.groups`: ds-parallel's groups helpers, views of its process mesh, plus DeepSpeed's TP globals.

`_get_sequence_parallel_group()`, `_get_data_parallel_world_size()`, ... are looked up on
`ds_parallel.groups` at each access. Needs the `parallel` extra.

DeepSpeed also keeps a (data_parallel, tensor_parallel) pair of groups in this module's globals
(`_DATA_PARALLEL_GROUP`, `_MODEL_PARALLEL_GROUP`, `_TENSOR_MODEL_PARALLEL_GROUP`), set by
`_init_tp_mesh_device` and read by `get_tensor_model_parallel_group()` and friends; scripts call these
and reset the globals directly, so they live here, in the module those scripts hold. For
`tensor_parallel.autotp_size` `initialize()` builds ds-parallel's mesh (`_tensor_parallel`) and, as
DeepSpeed does, publishes its groups here (`_set_tp_groups`), so these getters answer afterwards.
"""

from __future__ import annotations

import os
import sys
import types
from typing import TYPE_CHECKING, Any

from ds_engine import _comm as dist
from ds_engine._optional import require
from ds_engine._reexport import optional_reexport
from ds_engine._report.logging import log_dist

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.groups import *  # noqa: F403

_parallel_all, __getattr__, _parallel_dir = optional_reexport(
    "ds_engine._parallel.groups",
    "ds_parallel.groups",
    extra="parallel",
    feature="ds_engine._parallel.groups (deepspeed.utils.groups, the process mesh)",
)

#: torch's message when a backend cannot split its parent group into a DeviceMesh's groups.
_DEVICE_MESH_SPLIT_UNSUPPORTED = "No backend for the parent process group or its backend does not support splitting"

#: DeepSpeed's TP/DP groups (None until `_init_tp_mesh_device`); `_MODEL_PARALLEL_GROUP` is the TP group.
_TENSOR_MODEL_PARALLEL_GROUP: Any = None
_MODEL_PARALLEL_GROUP: Any = None
_DATA_PARALLEL_GROUP: Any = None

_TP_NAMES = [
    "get_data_parallel_group",
    "get_data_parallel_rank",
    "get_data_parallel_world_size",
    "get_model_parallel_group",
    "get_model_parallel_rank",
    "get_model_parallel_world_size",
    "get_tensor_model_parallel_group",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_src_rank",
    "get_tensor_model_parallel_world_size",
]
__all__ = [*_parallel_all, *_TP_NAMES]  # `mpu` (a property, below) is in ds_parallel.groups' list


def _check_layout(tensor_model_parallel_size: int, data_parallel_size: int | None) -> tuple[int, int]:
    world_size = dist.get_world_size()
    if tensor_model_parallel_size < 1 or world_size % tensor_model_parallel_size:
        raise ValueError(
            f"tensor_model_parallel_size={tensor_model_parallel_size} must be a positive divisor of the "
            f"world size {world_size}"
        )
    if data_parallel_size is None:
        data_parallel_size = world_size // tensor_model_parallel_size
    elif data_parallel_size * tensor_model_parallel_size != world_size:
        raise ValueError(
            f"data_parallel_size={data_parallel_size} x tensor_model_parallel_size={tensor_model_parallel_size} "
            f"must equal the world size {world_size}"
        )
    return tensor_model_parallel_size, data_parallel_size


def _init_tp_groups_with_new_group(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None) -> Any:
    """The (data_parallel, tensor_parallel) groups of a row-major 2-D mesh, made with one `new_group` per group.

    Every rank creates every group (torch requires it), data-parallel groups first: rank r is in the
    tensor-parallel group of the ranks `r // tp * tp ..` (consecutive) and in the data-parallel group of
    the ranks congruent to r modulo tp. Returns `(data_parallel_group, model_parallel_group)`.
    """
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP
    tp, dp = _check_layout(tensor_model_parallel_size, data_parallel_size)
    world_size, rank = dist.get_world_size(), dist.get_rank()
    data_parallel_group = tensor_parallel_group = None
    for tp_rank in range(tp):
        ranks = list(range(tp_rank, world_size, tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            data_parallel_group = group
    for dp_rank in range(dp):
        ranks = list(range(dp_rank * tp, (dp_rank + 1) * tp))
        group = dist.new_group(ranks)
        if rank in ranks:
            tensor_parallel_group = group
    assert data_parallel_group is not None and tensor_parallel_group is not None, f"rank {rank} is in no group"
    _DATA_PARALLEL_GROUP = data_parallel_group
    _TENSOR_MODEL_PARALLEL_GROUP = _MODEL_PARALLEL_GROUP = tensor_parallel_group
    return _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP


def _init_tp_mesh_device(tensor_model_parallel_size: int = 1, data_parallel_size: int | None = None) -> Any:
    """Set DeepSpeed's TP/DP groups from a (data_parallel, tensor_parallel) `DeviceMesh`; returns
    `(data_parallel_group, model_parallel_group)`, or None when they are already set (nothing is redone).

    Collective: every rank calls it. Two cases build the same groups with explicit `new_group` calls
    instead (`_init_tp_groups_with_new_group`): `TORCH_DISTRIBUTED_DEBUG=DETAIL` (its wrapper groups
    cannot be split, so the mesh is not tried), and a backend that refuses to split its parent group
    (torch's `RuntimeError` with `_DEVICE_MESH_SPLIT_UNSUPPORTED`; any other error propagates).
    """
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP
    if _TENSOR_MODEL_PARALLEL_GROUP is not None:
        return None
    tp, dp = _check_layout(tensor_model_parallel_size, data_parallel_size)
    if os.environ.get("TORCH_DISTRIBUTED_DEBUG", "").upper() == "DETAIL":
        log_dist("TORCH_DISTRIBUTED_DEBUG=DETAIL: TP/DP groups built with new_group, not a DeviceMesh", ranks=[0])
        return _init_tp_groups_with_new_group(tp, dp)
    try:
        mesh = dist.initialize_mesh_device((dp, tp), ("data_parallel", "tensor_parallel"))
    except RuntimeError as err:
        if _DEVICE_MESH_SPLIT_UNSUPPORTED not in str(err):
            raise
        log_dist("the backend cannot split process groups for a DeviceMesh: building the TP/DP groups with new_group")
        return _init_tp_groups_with_new_group(tp, dp)
    _TENSOR_MODEL_PARALLEL_GROUP = _MODEL_PARALLEL_GROUP = mesh.get_group(mesh_dim="tensor_parallel")
    _DATA_PARALLEL_GROUP = mesh.get_group(mesh_dim="data_parallel")
    return _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP


def _set_tp_groups(data_parallel_group: Any, tensor_parallel_group: Any) -> None:
    """Publish the groups initialize() trains with (the mesh's, or an mpu's) as DeepSpeed's TP/DP globals."""
    global _DATA_PARALLEL_GROUP, _MODEL_PARALLEL_GROUP, _TENSOR_MODEL_PARALLEL_GROUP
    _DATA_PARALLEL_GROUP = data_parallel_group
    _TENSOR_MODEL_PARALLEL_GROUP = _MODEL_PARALLEL_GROUP = tensor_parallel_group


def _require(group: Any, what: str) -> Any:
    if group is None:
        raise RuntimeError(f"the {what} group is not initialized (call deepspeed.utils.groups._init_tp_mesh_device)")
    return group


def get_tensor_model_parallel_group() -> Any:
    """This rank's tensor-parallel group (set by `_init_tp_mesh_device`)."""
    return _require(_TENSOR_MODEL_PARALLEL_GROUP, "tensor model parallel")


def get_model_parallel_group() -> Any:
    """This rank's model-parallel group: the tensor-parallel one."""
    return _require(_MODEL_PARALLEL_GROUP, "model parallel")


def get_data_parallel_group() -> Any:
    """This rank's data-parallel group (set by `_init_tp_mesh_device`)."""
    return _require(_DATA_PARALLEL_GROUP, "data parallel")


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(group=get_tensor_model_parallel_group())


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(group=get_tensor_model_parallel_group())


def get_tensor_model_parallel_src_rank() -> int:
    """The global rank of this rank's tensor-parallel group's first member (broadcast source for the group)."""
    return int(dist.get_global_rank(get_tensor_model_parallel_group(), 0))


def get_model_parallel_world_size() -> int:
    return get_tensor_model_parallel_world_size()


def get_model_parallel_rank() -> int:
    return get_tensor_model_parallel_rank()


def get_data_parallel_world_size() -> int:
    return dist.get_world_size(group=get_data_parallel_group())


def get_data_parallel_rank() -> int:
    return dist.get_rank(group=get_data_parallel_group())


def __dir__() -> list[str]:  # noqa: N807 - the PEP 562 hook
    return sorted({*_parallel_dir(), *_TP_NAMES})


class _GroupsModule(types.ModuleType):
    """This module, with DeepSpeed's `groups.mpu` read and written through to ds-parallel's groups (where the
    MoE layers read it), so a script's `deepspeed.utils.groups.mpu = mpu` reaches them."""

    @property
    def mpu(self) -> Any:
        return _parallel_groups().mpu

    @mpu.setter
    def mpu(self, value: Any) -> None:
        _parallel_groups().mpu = value


def _parallel_groups() -> Any:
    return require("ds_parallel", extra="parallel", feature="deepspeed.utils.groups.mpu").groups


sys.modules[__name__].__class__ = _GroupsModule
