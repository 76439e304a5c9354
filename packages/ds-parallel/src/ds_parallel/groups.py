"""DeepSpeed's `deepspeed.utils.groups` functions as views of the current `ParallelMesh`.

`initialize_mesh(...)` (or `set_mesh`) installs the process-wide mesh; until then the first call builds
the plain data-parallel layout (every rank one replica), as DeepSpeed's groups default to the world.
"""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup

from ds_parallel._dims import ParallelDims
from ds_parallel._mesh import ParallelMesh, build_mesh
from ds_parallel.moe import _groups as _experts

__all__ = [
    "_get_data_parallel_group",
    "_get_data_parallel_rank",
    "_get_data_parallel_world_size",
    "_create_expert_and_data_parallel",
    "_get_expert_broadcast_src_rank",
    "_get_expert_data_parallel_group",
    "_get_expert_data_parallel_group_dict",
    "_get_expert_data_parallel_group_ranks",
    "_get_expert_data_parallel_rank",
    "_get_expert_data_parallel_world_size",
    "_get_expert_parallel_group",
    "_get_expert_parallel_group_dict",
    "_get_expert_parallel_group_ranks",
    "_get_expert_parallel_ranks",
    "_get_max_expert_parallel_group",
    "_get_max_expert_size",
    "_get_max_expert_size_name",
    "_get_expert_parallel_rank",
    "_get_expert_parallel_world_size",
    "_get_model_parallel_group",
    "_get_model_parallel_rank",
    "_get_model_parallel_world_size",
    "_get_pipeline_parallel_group",
    "_get_sequence_data_parallel_group",
    "_get_sequence_data_parallel_rank",
    "_get_sequence_data_parallel_world_size",
    "_get_sequence_parallel_group",
    "_get_sequence_parallel_rank",
    "_get_sequence_parallel_world_size",
    "get_mesh",
    "initialize_mesh",
    "reset_mesh",
    "set_mesh",
]

_MESH: ParallelMesh | None = None


def initialize_mesh(dims: ParallelDims | None = None, **degrees: Any) -> ParallelMesh:
    """Build the process-wide mesh (`initialize_mesh(sp=2)`) and return it; see `build_mesh`.

    Raises:
        RuntimeError: a mesh with a different layout is already installed (call `reset_mesh()` first).
    """
    global _MESH
    mesh = build_mesh(dims, **degrees)
    if _MESH is not None and _MESH.dims != mesh.dims:
        raise RuntimeError(f"a different mesh is already installed ({_MESH!r}); reset_mesh() before {mesh!r}")
    _MESH = mesh
    return mesh


def set_mesh(mesh: ParallelMesh) -> None:
    """Install an already built mesh as the process-wide one."""
    global _MESH
    _MESH = mesh


def reset_mesh() -> None:
    """Forget the installed mesh and the expert groups (process groups stay alive until torch.distributed is
    torn down)."""
    global _MESH
    _MESH = None
    _experts.reset_expert_groups()


def get_mesh() -> ParallelMesh:
    """The installed mesh; the plain data-parallel one is built on first use."""
    global _MESH
    if _MESH is None:
        _MESH = build_mesh()
    return _MESH


def _get_data_parallel_group() -> ProcessGroup:
    """Replicas of the model (excluding sequence-parallel peers, which see the same samples)."""
    return get_mesh().group("dp")


def _get_data_parallel_world_size() -> int:
    return get_mesh().size("dp")


def _get_data_parallel_rank() -> int:
    return get_mesh().rank("dp")


def _get_sequence_parallel_group() -> ProcessGroup:
    """Ranks that share one sample's sequence (Ulysses all-to-alls run here)."""
    return get_mesh().group("sp")


def _get_sequence_parallel_world_size() -> int:
    return get_mesh().size("sp")


def _get_sequence_parallel_rank() -> int:
    return get_mesh().rank("sp")


def _get_sequence_data_parallel_group() -> ProcessGroup:
    """Data and sequence ranks together: gradients are reduced and ZeRO partitions over this group."""
    return get_mesh().group("dp_sp")


def _get_sequence_data_parallel_world_size() -> int:
    return get_mesh().size("dp_sp")


def _get_sequence_data_parallel_rank() -> int:
    return get_mesh().rank("dp_sp")


def _get_model_parallel_group() -> ProcessGroup:
    """Tensor-parallel peers (DeepSpeed's model-parallel group without an mpu)."""
    return get_mesh().group("tp")


def _get_model_parallel_world_size() -> int:
    return get_mesh().size("tp")


def _get_model_parallel_rank() -> int:
    return get_mesh().rank("tp")


def _get_expert_parallel_group(group_name: str | None = None) -> ProcessGroup:
    """The mesh's `ep` group, or with a name (`ep_size_{N}`) that degree's group (see `ds_parallel.moe`)."""
    if group_name is None:
        return get_mesh().group("ep")
    return _experts.get_expert_groups(group_name).ep_group


def _get_expert_parallel_world_size(group_name: str | None = None) -> int:
    if group_name is None:
        return get_mesh().size("ep")
    return _experts.get_expert_groups(group_name).ep_size


def _get_expert_parallel_rank(group_name: str | None = None) -> int:
    if group_name is None:
        return get_mesh().rank("ep")
    return _experts.get_expert_groups(group_name).ep_rank


def _create_expert_and_data_parallel(
    expert_parallel_size_: int, use_data_before_expert_parallel_: bool = False
) -> None:
    """Create the `ep_size_{N}` expert-parallel and expert-data-parallel groups (a collective)."""
    if use_data_before_expert_parallel_:
        raise NotImplementedError("use_data_before_expert_parallel_=True (the D+E rank layout) is not supported")
    _experts.create_expert_groups(expert_parallel_size_)


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel and expert-data-parallel rank lists of a world, computed without any process group.

    Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline stage (DeepSpeed's
    E + M + D layout). Each stage's data-parallel ranks at one tensor-parallel index (`i, i + tp, ...`)
    split into expert-parallel groups of `expert_parallel_size_` consecutive members; the members at the
    same position of those groups form an expert-data-parallel group. World 16, tp 2, ep 4 gives
    expert-parallel `[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], [9, 11, 13, 15]` and expert-data-parallel
    `[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], ...`.

    Raises:
        ValueError: a size does not divide what it must (named with the values).
        NotImplementedError: `use_data_before_expert_parallel_=True` (the D + E layout).
    """
    if use_data_before_expert_parallel_:
        raise NotImplementedError("use_data_before_expert_parallel_=True (the D+E rank layout) is not supported")
    model_size = tensor_parallel_size_ * pipeline_parallel_size_
    if min(world_size, tensor_parallel_size_, expert_parallel_size_, pipeline_parallel_size_) < 1:
        raise ValueError(
            f"sizes must be >= 1: world_size={world_size}, tensor_parallel_size_={tensor_parallel_size_}, "
            f"expert_parallel_size_={expert_parallel_size_}, pipeline_parallel_size_={pipeline_parallel_size_}"
        )
    if world_size % model_size:
        raise ValueError(
            f"world_size {world_size} is not divisible by "
            f"tensor_parallel_size_ x pipeline_parallel_size_ = {model_size}"
        )
    dp_size = world_size // model_size
    if dp_size % expert_parallel_size_:
        raise ValueError(
            f"the data-parallel size {dp_size} is not divisible by expert_parallel_size_ {expert_parallel_size_}"
        )
    stage_size = world_size // pipeline_parallel_size_
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for stage_start in range(0, world_size, stage_size):
        for tp_index in range(tensor_parallel_size_):
            dp_ranks = list(range(stage_start + tp_index, stage_start + stage_size, tensor_parallel_size_))
            chunks = [dp_ranks[i : i + expert_parallel_size_] for i in range(0, dp_size, expert_parallel_size_)]
            ep_groups.extend(chunks)
            edp_groups.extend([list(column) for column in zip(*chunks, strict=True)])
    return ep_groups, edp_groups


def _get_expert_data_parallel_group(group_name: str) -> ProcessGroup:
    """Ranks holding the same experts of degree `group_name`: expert gradients are reduced here."""
    return _experts.get_expert_groups(group_name).edp_group


def _get_expert_data_parallel_world_size(group_name: str) -> int:
    return _experts.get_expert_groups(group_name).edp_size


def _get_expert_data_parallel_rank(group_name: str) -> int:
    return _experts.get_expert_groups(group_name).edp_rank


def _get_expert_broadcast_src_rank(group_name: str) -> int:
    """Global rank of the first member of this rank's expert-data-parallel group."""
    return _experts.get_expert_groups(group_name).edp_ranks[0]


def _get_expert_parallel_group_ranks(group_name: str) -> list[int]:
    """Global ranks of this rank's expert-parallel group of degree `group_name`."""
    return list(_experts.get_expert_groups(group_name).ep_ranks)


def _get_expert_data_parallel_group_ranks(group_name: str) -> list[int]:
    """Global ranks of this rank's expert-data-parallel group of degree `group_name`."""
    return list(_experts.get_expert_groups(group_name).edp_ranks)


def _get_max_expert_size() -> int | None:
    """The largest expert-parallel degree with groups (None before any)."""
    sizes = [g.ep_size for g in _experts.expert_groups().values()]
    return max(sizes) if sizes else None


def _get_max_expert_size_name() -> str:
    return _experts.expert_group_name(_get_max_expert_size() or 1)


def _get_max_expert_parallel_group() -> ProcessGroup:
    return _get_expert_parallel_group(_get_max_expert_size_name())


def _get_expert_parallel_group_dict() -> dict[str, ProcessGroup]:
    return {name: g.ep_group for name, g in _experts.expert_groups().items()}


def _get_expert_data_parallel_group_dict() -> dict[str, ProcessGroup]:
    return {name: g.edp_group for name, g in _experts.expert_groups().items()}


def _get_pipeline_parallel_group() -> ProcessGroup:
    return get_mesh().group("pp")
