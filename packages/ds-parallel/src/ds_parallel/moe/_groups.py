"""Expert-parallel and expert-data-parallel groups, one pair per expert-parallel degree, named `ep_size_{N}`.

DeepSpeed lets every MoE layer pick its own `ep_size` and keys the groups by that name. Here each pair is
a view of a mesh: the installed one (`ds_parallel.groups`) when its `ep` degree is N, else a mesh built
with the installed layout's pp/sp/tp and `ep=N`. Either way the layout is DeepSpeed's: the expert-parallel
group is N consecutive data-parallel ranks ({0,1}, {2,3} for N=2 on 4 ranks) and the expert-data-parallel
group strides over them ({0,2}, {1,3}); expert parameters are replicated, and their gradients reduced,
over the latter. With sequence parallelism the expert-data-parallel group also holds the sequence-parallel
peers (the mesh's `edp_sp`): they keep the same experts and route their own tokens to them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_parallel._dims import ParallelDims
from ds_parallel._mesh import ParallelMesh, build_mesh
from ds_parallel.moe._layouts import expert_rank_lists

__all__ = [
    "ExpertGroups",
    "create_expert_groups",
    "create_expert_groups_from_layout",
    "expert_tensor_parallel_size",
    "expert_group_name",
    "expert_groups",
    "get_expert_groups",
    "register_expert_groups",
    "reset_expert_groups",
]

_REGISTRY: dict[str, ExpertGroups] = {}
#: The tensor-parallel degree of the experts (DeepSpeed's `expert_tensor_parallel_world_size`): the model's
#: tensor-parallel degree once a layer set up expert tensor parallelism, else 1.
_EXPERT_TP_SIZE = 1


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
        edp_group=mesh.group("edp_sp"),  # sequence-parallel peers hold the same experts, fed other tokens
        ep_ranks=tuple(mesh.ranks("ep")),
        edp_ranks=tuple(mesh.ranks("edp_sp")),
        ep_rank=mesh.rank("ep"),
        edp_rank=mesh.rank("edp_sp"),
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


def create_expert_groups_from_layout(
    ep_size: int,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    expert_tensor_parallel: bool = False,
    data_before_expert: bool = False,
    record_expert_tp: bool = True,
) -> ExpertGroups:
    """The groups of degree `ep_size` in one of DeepSpeed's explicit layouts (`ds_parallel.moe._layouts`),
    created with one `new_group` per group on first use (a collective: every rank must call it).

    Used where the mesh's own `ep` dim is not the layout: a tensor-parallel model (tensor-parallel peers
    share tokens), expert tensor parallelism, or the data-before-expert order.

    `record_expert_tp`: with `expert_tensor_parallel`, the experts' tensor-parallel degree becomes `tp_size`
    (False: only the tensor-parallel-lane ordering is wanted).

    Raises:
        ValueError: the sizes do not divide the world (named).
    """
    global _EXPERT_TP_SIZE
    name = expert_group_name(ep_size)
    if name in _REGISTRY:
        return _REGISTRY[name]
    ep_lists, edp_lists = expert_rank_lists(
        dist.get_world_size(),
        ep_size,
        tp_size=tp_size,
        pp_size=pp_size,
        expert_tensor_parallel=expert_tensor_parallel,
        data_before_expert=data_before_expert,
    )
    groups = register_expert_groups(ep_size, ep_lists, edp_lists)
    if expert_tensor_parallel and record_expert_tp:
        _EXPERT_TP_SIZE = tp_size
    return groups


def register_expert_groups(
    ep_size: int, ep_lists: Sequence[Sequence[int]], edp_lists: Sequence[Sequence[int]]
) -> ExpertGroups:
    """Create (one `new_group` per list, a collective: every rank passes the same lists) and register the
    `ep_size_{N}` groups from explicit rank lists; the registered ones when the name is known already.

    For layouts no mesh expresses (AutoEP folded with AutoTP: expert-parallel groups of consecutive ranks
    across tensor-parallel lanes).

    Raises:
        ValueError: this rank is in no list, or in several, of a kind.
    """
    name = expert_group_name(ep_size)
    if name in _REGISTRY:
        return _REGISTRY[name]
    rank = dist.get_rank()
    mine: dict[str, tuple[ProcessGroup, list[int]]] = {}
    for kind, lists in (("ep", ep_lists), ("edp", edp_lists)):
        for ranks in lists:  # every rank creates every group, in the same order (torch requires it)
            group = dist.new_group(list(ranks))
            if rank in ranks:
                if kind in mine:
                    raise ValueError(f"expert group lists of {name}: rank {rank} is in two {kind} groups")
                mine[kind] = (group, list(ranks))
        if kind not in mine:
            raise ValueError(f"expert group lists of {name}: rank {rank} is in no {kind} group")
    (ep_group, ep_ranks), (edp_group, edp_ranks) = mine["ep"], mine["edp"]
    _REGISTRY[name] = ExpertGroups(
        name=name,
        ep_size=ep_size,
        ep_group=ep_group,
        edp_group=edp_group,
        ep_ranks=tuple(ep_ranks),
        edp_ranks=tuple(edp_ranks),
        ep_rank=ep_ranks.index(rank),
        edp_rank=edp_ranks.index(rank),
    )
    return _REGISTRY[name]


def expert_tensor_parallel_size() -> int:
    """The experts' tensor-parallel degree (1 unless a layer set up expert tensor parallelism)."""
    return _EXPERT_TP_SIZE


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
    global _EXPERT_TP_SIZE
    _REGISTRY.clear()
    _EXPERT_TP_SIZE = 1
