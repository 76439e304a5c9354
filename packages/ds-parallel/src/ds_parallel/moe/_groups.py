"""Expert-parallel and expert-data-parallel groups, one pair per expert-parallel degree, named `ep_size_{N}`.

DeepSpeed lets every MoE layer pick its own `ep_size` and keys the groups by that name. Here each pair is
a view of a mesh: the installed one (`ds_parallel.groups`) when its `ep` degree is N, else a mesh built
with the installed layout's pp/sp/tp and `ep=N`. Either way the layout is DeepSpeed's: the expert-parallel
group is N consecutive data-parallel ranks ({0,1}, {2,3} for N=2 on 4 ranks) and the expert-data-parallel
group strides over them ({0,2}, {1,3}); expert parameters are replicated, and their gradients reduced,
over the latter.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed import ProcessGroup

from ds_parallel._dims import ParallelDims
from ds_parallel._mesh import ParallelMesh, build_mesh

__all__ = [
    "ExpertGroups",
    "create_expert_groups",
    "expert_group_name",
    "expert_groups",
    "get_expert_groups",
    "reset_expert_groups",
]

_REGISTRY: dict[str, ExpertGroups] = {}


@dataclass(frozen=True)
class ExpertGroups:
    """The groups one expert-parallel degree uses, and this rank's place in them."""

    name: str
    ep_size: int
    ep_group: ProcessGroup
    edp_group: ProcessGroup
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]
    ep_rank: int
    edp_rank: int

    @property
    def edp_size(self) -> int:
        return len(self.edp_ranks)


def expert_group_name(ep_size: int) -> str:
    """DeepSpeed's key for the groups of an expert-parallel degree."""
    return f"ep_size_{ep_size}"


def _groups_from(mesh: ParallelMesh, name: str) -> ExpertGroups:
    return ExpertGroups(
        name=name,
        ep_size=mesh.size("ep"),
        ep_group=mesh.group("ep"),
        edp_group=mesh.group("edp"),
        ep_ranks=tuple(mesh.ranks("ep")),
        edp_ranks=tuple(mesh.ranks("edp")),
        ep_rank=mesh.rank("ep"),
        edp_rank=mesh.rank("edp"),
    )


def create_expert_groups(ep_size: int) -> ExpertGroups:
    """The groups of degree `ep_size`, created on first use (a collective: every rank must call it).

    Raises:
        ValueError: `ep_size` does not divide the data-parallel world (every factor named).
    """
    name = expert_group_name(ep_size)
    if name in _REGISTRY:
        return _REGISTRY[name]
    from ds_parallel import groups  # the installed mesh; groups also answers the expert queries from here

    mesh = groups.get_mesh()
    if mesh.dims.ep != ep_size:
        d = mesh.dims
        if d.dp % ep_size:
            raise ValueError(
                f"MoE ep_size={ep_size} must divide the data-parallel world size {d.dp} "
                f"(world {d.world_size} = pp {d.pp} x dp {d.dp} x sp {d.sp} x tp {d.tp})"
            )
        mesh = build_mesh(ParallelDims(world_size=d.world_size, pp=d.pp, dp=d.dp, ep=ep_size, sp=d.sp, tp=d.tp))
    _REGISTRY[name] = _groups_from(mesh, name)
    return _REGISTRY[name]


def get_expert_groups(name: str) -> ExpertGroups:
    """The groups registered under `name` (`ep_size_{N}`).

    Raises:
        KeyError: no MoE layer of that degree has set up its groups yet.
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise KeyError(
            f"expert parallel group {name!r} is not initialized (known: {known}); the engine creates it "
            "for each MoE layer at deepspeed.initialize(), or call MoE.set_deepspeed_parallelism()"
        ) from None


def expert_groups() -> dict[str, ExpertGroups]:
    """Every registered degree's groups, by name (a copy)."""
    return dict(_REGISTRY)


def reset_expert_groups() -> None:
    """Forget the registered groups (the process groups live until torch.distributed is torn down)."""
    _REGISTRY.clear()
