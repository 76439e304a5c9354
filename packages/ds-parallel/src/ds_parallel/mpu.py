"""`MeshMPU`: DeepSpeed's model-parallel unit (`mpu`) answered from a `ParallelMesh`.

`ds_engine.initialize(mpu=...)` reads the data-parallel group from it; with sequence parallelism on it
also reads `get_sequence_parallel_world_size()` and `get_sequence_data_parallel_group()` (gradients are
reduced and ZeRO partitions over data x sequence ranks, while batches are counted per data rank).
"""

from __future__ import annotations

from torch.distributed import ProcessGroup

from ds_parallel._mesh import ParallelMesh

__all__ = ["MeshMPU"]


class MeshMPU:
    """The mpu methods Megatron-style code and DeepSpeed call, each a view of one mesh dim."""

    def __init__(self, mesh: ParallelMesh) -> None:
        self.mesh = mesh

    # data parallel (model replicas; sequence peers excluded)
    def get_data_parallel_group(self) -> ProcessGroup:
        return self.mesh.group("dp")

    def get_data_parallel_world_size(self) -> int:
        return self.mesh.size("dp")

    def get_data_parallel_rank(self) -> int:
        return self.mesh.rank("dp")

    # tensor (model) parallel
    def get_model_parallel_group(self) -> ProcessGroup:
        return self.mesh.group("tp")

    def get_model_parallel_world_size(self) -> int:
        return self.mesh.size("tp")

    def get_model_parallel_rank(self) -> int:
        return self.mesh.rank("tp")

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_rank = get_model_parallel_rank

    # pipeline
    def get_pipeline_model_parallel_group(self) -> ProcessGroup:
        return self.mesh.group("pp")

    def get_pipeline_model_parallel_world_size(self) -> int:
        return self.mesh.size("pp")

    def get_pipeline_model_parallel_rank(self) -> int:
        return self.mesh.rank("pp")

    # sequence parallel
    def get_sequence_parallel_group(self) -> ProcessGroup:
        return self.mesh.group("sp")

    def get_sequence_parallel_world_size(self) -> int:
        return self.mesh.size("sp")

    def get_sequence_parallel_rank(self) -> int:
        return self.mesh.rank("sp")

    def get_sequence_data_parallel_group(self) -> ProcessGroup:
        return self.mesh.group("dp_sp")

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.mesh.size("dp_sp")

    def get_sequence_data_parallel_rank(self) -> int:
        return self.mesh.rank("dp_sp")

    def __repr__(self) -> str:
        return f"MeshMPU({self.mesh!r})"
