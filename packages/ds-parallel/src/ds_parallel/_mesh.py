"""`ParallelMesh`: the process layout as one `DeviceMesh` with named dims; every group is a view of it.

Named 1-D views: `pp`, `dp` (= `edp` x `ep`), `edp`, `ep`, `sp`, `tp`, `dp_sp` (the data and
sequence ranks together: what ZeRO partitions and reduces gradients over when sequence parallelism is on),
and `edp_sp` (`edp` x `sp`: every rank holding the same experts, since sequence-parallel peers route their
own tokens to them; expert gradients are reduced over it).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ds_comm import get_accelerator
from ds_parallel._dims import MESH_DIM_NAMES, ParallelDims

__all__ = ["ParallelMesh", "build_mesh"]

#: Flattened views: name -> the mesh dims it joins (outer first; `edp_sp` skips `ep`).
_FLATTENED: dict[str, tuple[str, ...]] = {
    "dp": ("edp", "ep"),
    "dp_sp": ("edp", "ep", "sp"),
    "edp_sp": ("edp", "sp"),
}


class ParallelMesh:
    """A `DeviceMesh` over all ranks plus the `ParallelDims` it was built from.

    `group(name)`, `size(name)`, `rank(name)` answer for any dim or flattened view; `ranks(name)` lists
    the global ranks of this process's group along it.
    """

    def __init__(self, dims: ParallelDims, mesh: DeviceMesh, flattened: dict[str, DeviceMesh]) -> None:
        self.dims = dims
        self.device_mesh = mesh
        self._flattened = flattened  # torch wants flattened views kept by the caller, not re-sliced

    @property
    def dim_names(self) -> tuple[str, ...]:
        return (*MESH_DIM_NAMES, *_FLATTENED)

    def _sub(self, name: str) -> DeviceMesh:
        if name not in self.dim_names:
            raise KeyError(f"ParallelMesh has no dim {name!r}; dims: {', '.join(self.dim_names)}")
        if name in self._flattened:
            return self._flattened[name]
        return self.device_mesh[name]

    def group(self, name: str) -> ProcessGroup:
        return self._sub(name).get_group()

    def size(self, name: str) -> int:
        return self._sub(name).size()

    def rank(self, name: str) -> int:
        return self._sub(name).get_local_rank()

    def ranks(self, name: str) -> list[int]:
        return dist.get_process_group_ranks(self.group(name))

    def __repr__(self) -> str:
        d = self.dims
        return f"ParallelMesh(pp={d.pp}, dp={d.dp}, ep={d.ep}, sp={d.sp}, tp={d.tp}, world_size={d.world_size})"


def build_mesh(dims: ParallelDims | None = None, *, device_type: str | None = None, **degrees: Any) -> ParallelMesh:
    """Create the mesh (and so every group) on the initialised default process group.

    Args:
        dims: the layout; or pass the degrees as keywords (`build_mesh(sp=2)`), world_size taken from
            torch.distributed.
        device_type: "cpu", "cuda", ...; default the accelerator's.

    Raises:
        RuntimeError: torch.distributed is not initialised.
        ValueError: the degrees do not fit the world size (every factor named).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_mesh needs torch.distributed initialised (ds_comm.init_distributed())")
    if dims is None:
        dims = ParallelDims(world_size=dist.get_world_size(), **degrees)
    elif degrees:
        raise ValueError(f"build_mesh: pass dims or keyword degrees, not both (got {sorted(degrees)})")
    if dims.world_size != dist.get_world_size():
        raise ValueError(
            f"ParallelDims.world_size {dims.world_size} != torch.distributed world size {dist.get_world_size()}"
        )
    device_type = device_type or get_accelerator().name
    mesh = init_device_mesh(device_type, dims.mesh_shape, mesh_dim_names=MESH_DIM_NAMES)
    flattened = {name: mesh[parts]._flatten(name) for name, parts in _FLATTENED.items()}
    return ParallelMesh(dims, mesh, flattened)
