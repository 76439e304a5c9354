"""DeepSpeed's `deepspeed.utils.groups` functions as views of the current `ParallelMesh`.

`initialize_mesh(...)` (or `set_mesh`) installs the process-wide mesh; until then the first call builds
the plain data-parallel layout (every rank one replica), as DeepSpeed's groups default to the world.

`mpu` is DeepSpeed's `groups.mpu`: a client's model-parallel unit, published by the engine (or set by a
script). While set, the data-parallel and tensor-parallel answers are the mpu's, as in DeepSpeed.
"""

from __future__ import annotations

from typing import Any

from torch.distributed import ProcessGroup

from ds_parallel._dims import ParallelDims
from ds_parallel._mesh import ParallelMesh, build_mesh
from ds_parallel.moe import _groups as _experts
from ds_parallel.moe._layouts import expert_rank_lists

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
    "_get_expert_model_parallel_world_size",
    "_create_expert_data_and_model_parallel",
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
    "mpu",
    "initialize_mesh",
    "reset_mesh",
    "set_mesh",
]

_MESH: ParallelMesh | None = None
#: DeepSpeed's `groups.mpu` (None: the mesh answers).
mpu: Any = None


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
    global _MESH, mpu
    _MESH = None
    mpu = None
    _experts.reset_expert_groups()


def get_mesh() -> ParallelMesh:
    """The installed mesh; the plain data-parallel one is built on first use."""
    global _MESH
    if _MESH is None:
        _MESH = build_mesh()
    return _MESH


def _get_data_parallel_group() -> ProcessGroup:
    """Replicas of the model (excluding sequence-parallel peers, which see the same samples)."""
    if mpu is not None:
        return mpu.get_data_parallel_group()
    return get_mesh().group("dp")


def _get_data_parallel_world_size() -> int:
    if mpu is not None:
        return int(mpu.get_data_parallel_world_size())
    return get_mesh().size("dp")


def _get_data_parallel_rank() -> int:
    if mpu is not None:
        return int(mpu.get_data_parallel_rank())
    return get_mesh().rank("dp")


def _tensor_parallel() -> tuple[int, ProcessGroup | None, int]:
    """`(size, group, rank)` of this rank's tensor-parallel group: the mpu's when one is published, else the
    mesh's `tp` dim (a mesh is not built for this when none is installed: no tensor parallelism then)."""
    if mpu is not None:
        size = getattr(mpu, "get_tensor_model_parallel_world_size", mpu.get_model_parallel_world_size)()
        group = getattr(mpu, "get_tensor_model_parallel_group", mpu.get_model_parallel_group)()
        rank = getattr(mpu, "get_tensor_model_parallel_rank", mpu.get_model_parallel_rank)()
        return int(size), group, int(rank)
    if _MESH is None:
        return 1, None, 0
    return _MESH.size("tp"), _MESH.group("tp"), _MESH.rank("tp")


def _pipeline_parallel_size() -> int:
    if mpu is not None:
        get = getattr(mpu, "get_pipeline_model_parallel_world_size", None) or getattr(
            mpu, "get_pipe_parallel_world_size", None
        )
        return int(get()) if get is not None else 1
    return _MESH.size("pp") if _MESH is not None else 1


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
    """Tensor-parallel peers (the mpu's model-parallel group when one is published)."""
    if mpu is not None:
        return mpu.get_model_parallel_group()
    return get_mesh().group("tp")


def _get_model_parallel_world_size() -> int:
    if mpu is not None:
        return int(mpu.get_model_parallel_world_size())
    return get_mesh().size("tp")


def _get_model_parallel_rank() -> int:
    if mpu is not None:
        return int(mpu.get_model_parallel_rank())
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
    expert_parallel_size_: int,
    mp_size: int | None = None,
    pp_size: int | None = None,
    mp_mode: str = "tp",
    use_data_before_expert_parallel_: bool = False,
    folding_spec: Any = None,
) -> None:
    """Create the `ep_size_{N}` expert-parallel and expert-data-parallel groups (a collective).

    `mp_size` None or 1, experts that are not tensor-parallel: with a tensor-parallel model (the published
    mpu's or the mesh's `tp`) the groups are DeepSpeed's E + D layout over the world, tensor-parallel peers
    included; with the data-before-expert flag the D + E layout (`ds_parallel.moe._layouts`); otherwise
    views of the mesh. `mp_size > 1`: `mp_mode="tp"` forms the groups inside each tensor-parallel lane
    (E + M + D), `"sp"` over consecutive ranks (E + D).

    Raises:
        NotImplementedError: a `folding_spec` (AutoEP's folding tables), or the data-before-expert flag with
            `mp_size > 1` (as in DeepSpeed).
        ValueError: an unknown `mp_mode`, or sizes that do not divide the world.
    """
    if folding_spec is not None:
        raise NotImplementedError("_create_expert_and_data_parallel(folding_spec=...): AutoEP folding tables")
    if mp_mode not in ("tp", "sp"):
        raise ValueError(f"_create_expert_and_data_parallel: mp_mode must be 'tp' or 'sp', got {mp_mode!r}")
    mp = mp_size or 1
    if mp > 1 and use_data_before_expert_parallel_:
        raise NotImplementedError("use_data_before_expert_parallel_ is not supported with mp_size > 1")
    if mp == 1 and _tensor_parallel()[0] == 1 and not use_data_before_expert_parallel_ and pp_size is None:
        _experts.create_expert_groups(expert_parallel_size_)
        return
    _experts.create_expert_groups_from_layout(
        expert_parallel_size_,
        tp_size=mp if mp_mode == "tp" else 1,
        pp_size=pp_size or _pipeline_parallel_size(),
        expert_tensor_parallel=mp > 1 and mp_mode == "tp",
        data_before_expert=use_data_before_expert_parallel_,
        record_expert_tp=False,
    )


def _create_expert_data_and_model_parallel(
    expert_parallel_size_: int, mpu: Any, use_data_before_expert_parallel_: bool = False
) -> None:
    """Create the `ep_size_{N}` groups for tensor-parallel experts (a collective): expert groups are formed
    inside each tensor-parallel lane (E + M + D, or D + M + E with the flag), and the experts'
    tensor-parallel degree becomes the model's (`_get_expert_model_parallel_world_size`)."""
    global_mpu = mpu if mpu is not None else globals()["mpu"]
    if global_mpu is None:
        tp_size, pp_size = _tensor_parallel()[0], _pipeline_parallel_size()
    else:
        tp_size = int(
            getattr(global_mpu, "get_tensor_model_parallel_world_size", global_mpu.get_model_parallel_world_size)()
        )
        get_pp = getattr(global_mpu, "get_pipeline_model_parallel_world_size", None)
        pp_size = int(get_pp()) if get_pp is not None else 1
    _experts.create_expert_groups_from_layout(
        expert_parallel_size_,
        tp_size=tp_size,
        pp_size=pp_size,
        expert_tensor_parallel=True,
        data_before_expert=use_data_before_expert_parallel_,
    )


def _get_expert_model_parallel_world_size() -> int:
    """The experts' tensor-parallel degree: 1 unless a layer enabled expert tensor parallelism."""
    return _experts.expert_tensor_parallel_size()


def _get_expert_parallel_ranks(
    world_size: int,
    tensor_parallel_size_: int,
    expert_parallel_size_: int,
    pipeline_parallel_size_: int = 1,
    use_data_before_expert_parallel_: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """The expert-parallel and expert-data-parallel rank lists of tensor-parallel experts, computed without
    any process group.

    Ranks are laid out tensor-parallel fastest, then data-parallel, then pipeline stage. Each stage's
    data-parallel ranks at one tensor-parallel index (`i, i + tp, ...`) split into expert-parallel groups of
    `expert_parallel_size_` consecutive members (E + M + D), or of members a stride apart
    (D + M + E, `use_data_before_expert_parallel_`); the rest of each lane's split is the expert-data-parallel
    groups. World 16, tp 2, ep 4 gives expert-parallel `[0, 2, 4, 6], [8, 10, 12, 14], [1, 3, 5, 7], ...` and
    expert-data-parallel `[0, 8], [2, 10], [4, 12], [6, 14], [1, 9], ...`.

    Raises:
        ValueError: a size does not divide what it must (named with the values).
    """
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
    if (world_size // model_size) % expert_parallel_size_:
        raise ValueError(
            f"the data-parallel size {world_size // model_size} is not divisible by "
            f"expert_parallel_size_ {expert_parallel_size_}"
        )
    return expert_rank_lists(
        world_size,
        expert_parallel_size_,
        tp_size=tensor_parallel_size_,
        pp_size=pipeline_parallel_size_,
        expert_tensor_parallel=True,
        data_before_expert=use_data_before_expert_parallel_,
    )


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
