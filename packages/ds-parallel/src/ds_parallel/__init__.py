"""ds-parallel: model parallelism beyond pipelining, over one description of the process layout.

`ParallelDims` + `build_mesh` give the layout as a `torch.distributed.device_mesh.DeviceMesh` with
named dims (pp, edp x ep = dp, sp, tp); `ds_parallel.groups` answers DeepSpeed's `groups` functions
and `MeshMPU` the `mpu` methods from it. `ds_parallel.sequence` holds DeepSpeed-Ulysses
(`DistributedAttention`); `ds_parallel.ulysses_sp` holds ALST for Hugging Face models; `ds_parallel.moe`
holds DeepSpeed-MoE (`MoE`, gating, the expert-parallel all-to-all);
`ds_parallel.autoep` converts a Hugging Face MoE model to expert parallelism (AutoEP);
`ds_parallel.tensor` holds AutoTP (automatic tensor parallelism over the "tp" dim).
"""

from __future__ import annotations

from ds_parallel import autoep, groups, moe, tensor
from ds_parallel.__about__ import __version__
from ds_parallel._dims import MESH_DIM_NAMES, ParallelDims
from ds_parallel._mesh import ParallelMesh, build_mesh
from ds_parallel.mpu import MeshMPU
from ds_parallel.sequence import DistributedAttention, seq_all_to_all

__all__ = [
    "MESH_DIM_NAMES",
    "DistributedAttention",
    "MeshMPU",
    "ParallelDims",
    "ParallelMesh",
    "__version__",
    "autoep",
    "build_mesh",
    "groups",
    "moe",
    "seq_all_to_all",
    "tensor",
]
