"""`initialize_mesh_device`: a `DeviceMesh` over the world on the accelerator's device type.

DeepSpeed's `deepspeed.comm.initialize_mesh_device(mesh_shape, mesh_dim_names)` is how its groups
module builds a (data_parallel, tensor_parallel) mesh; ds-parallel builds its own, richer mesh with
`init_device_mesh` directly. This is the plain call under DeepSpeed's name, so code written against
`deepspeed.comm` (and `deepspeed.utils.groups`) runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from ds_comm.accelerator import get_accelerator
from ds_comm.collectives import get_world_size, is_initialized

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["initialize_mesh_device"]


def initialize_mesh_device(mesh_shape: Sequence[int], mesh_dim_names: Sequence[str]) -> DeviceMesh:
    """A `DeviceMesh` of shape `mesh_shape` over all ranks (row-major: the last dim holds consecutive ranks).

    Collective: every rank calls it with the same arguments. torch creates one process group per mesh
    dim; a backend that cannot split its parent group makes torch raise `RuntimeError` (callers such as
    `deepspeed.utils.groups._init_tp_mesh_device` fall back to explicit `new_group` calls then).

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: `mesh_shape` and `mesh_dim_names` differ in length, or the shape's product is not
            the world size.
    """
    if not is_initialized():
        raise RuntimeError("initialize_mesh_device needs torch.distributed initialised (ds_comm.init_distributed())")
    shape, names = tuple(int(n) for n in mesh_shape), tuple(mesh_dim_names)
    if len(shape) != len(names):
        raise ValueError(f"initialize_mesh_device: mesh_shape {shape} and mesh_dim_names {names} differ in length")
    size = 1
    for n in shape:
        size *= n
    if size != get_world_size():
        raise ValueError(
            f"initialize_mesh_device: mesh_shape {shape} covers {size} ranks, the world has {get_world_size()}"
        )
    from torch.distributed.device_mesh import init_device_mesh  # only the callers that build a mesh pay for it

    return init_device_mesh(get_accelerator().name, shape, mesh_dim_names=names)
