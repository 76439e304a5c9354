"""AutoEP folded with AutoTP: the rank layout of one pipeline stage, as pure arithmetic.

Folding runs the dense layers tensor-parallel (`tp`) and the routed experts expert-parallel (`ep`, times
`etp` expert-internal tensor parallelism) over the *same* ranks of a stage. The stage's ranks are laid
out as DeepSpeed 0.19.8 lays them out, so group tables agree rank for rank across the two implementations:

- tensor-parallel groups are consecutive ranks (`[0, 1], [2, 3], ...` for tp 2);
- dense data-parallel groups are the TP lanes, strided by `tp` (`[0, 2, 4, 6], [1, 3, 5, 7]`);
- expert-parallel groups are consecutive runs of `ep` ranks (so an EP group stays inside a node when ranks
  are numbered node by node), and may span TP lanes;
- expert-data-parallel groups take the same position of every EP group in the stage.

Nothing here creates a process group; `FoldingGroupHandles` only carries groups a caller made. `_fold` creates
the groups from these tables and runs the folded dispatch; ds-engine's initialize() checks a folded layout
with `build_folding_spec` and `validate_folding_global` before any group exists.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

__all__ = [
    "FoldingGroupHandles",
    "FoldingGroupTables",
    "ParallelFoldingSpec",
    "assert_group_matches_spec",
    "build_folding_spec",
    "expected_folding_group_tables",
    "local_folding_ranks",
    "validate_folding_global",
]

RankGroups = tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class ParallelFoldingSpec:
    """The sizes of one folded layout; `dp_size` (dense) and `edp_size` (experts) are derived."""

    world_size: int
    pp_size: int
    stage_size: int
    """Ranks per pipeline stage: world_size / pp_size."""
    tp_size: int
    dp_size: int
    """Dense data-parallel degree: stage_size / tp_size."""
    ep_size: int
    etp_size: int
    edp_size: int
    """Expert data-parallel degree (replicas of each expert): stage_size / (ep_size * etp_size)."""
    mp_mode: str = "tp"
    """"tp" when the dense layers are tensor-parallel, "sp" when they are not (sequence/data only)."""


@dataclasses.dataclass(frozen=True)
class FoldingGroupTables:
    """Every group of each kind, as tuples of global ranks, in DeepSpeed's order."""

    tp_groups: RankGroups
    dense_dp_groups: RankGroups
    ep_groups: RankGroups
    edp_groups: RankGroups


@dataclasses.dataclass(frozen=True)
class FoldingGroupHandles:
    """This rank's four process groups with the rank lists they were built from (made by the caller)."""

    spec: ParallelFoldingSpec
    tp_group: Any
    dense_dp_group: Any
    ep_group: Any
    edp_group: Any
    ep_group_name: str
    """DeepSpeed's expert-group key, `ep_size_{N}`."""
    tp_ranks: tuple[int, ...]
    dense_dp_ranks: tuple[int, ...]
    ep_ranks: tuple[int, ...]
    edp_ranks: tuple[int, ...]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def build_folding_spec(
    *, world_size: int, pp_size: int, tp_size: int, ep_size: int, etp_size: int = 1, mp_mode: str = "tp"
) -> ParallelFoldingSpec:
    """Check the sizes tile a stage and derive the dense and expert data-parallel degrees.

    Raises:
        ValueError: a size is not a positive integer, `pp_size` does not divide the world, or `tp_size` or
            `ep_size * etp_size` does not divide the stage; the message names the config key and the valid values.
    """
    for key, value in (
        ("world_size", world_size),
        ("pp_size", pp_size),
        ("tensor_parallel.autotp_size", tp_size),
        ("expert_parallel.autoep_size", ep_size),
        ("expert_parallel.expert_tensor_parallel_size", etp_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be a positive integer, got {value!r}")
    if world_size % pp_size:
        raise ValueError(
            f"pp_size={pp_size} must divide world_size={world_size}. Valid pp_size values: {_divisors(world_size)}"
        )
    stage = world_size // pp_size
    where = f"the stage size (world_size={world_size} / pp_size={pp_size} = {stage})"
    if stage % tp_size:
        raise ValueError(
            f"tensor_parallel.autotp_size={tp_size} must divide {where}. Valid autotp_size values: {_divisors(stage)}"
        )
    width = ep_size * etp_size
    if stage % width:
        raise ValueError(
            "expert_parallel.autoep_size * expert_parallel.expert_tensor_parallel_size "
            f"({ep_size} * {etp_size} = {width}) must divide {where}. Valid expert-width values: {_divisors(stage)}"
        )
    return ParallelFoldingSpec(
        world_size=world_size,
        pp_size=pp_size,
        stage_size=stage,
        tp_size=tp_size,
        dp_size=stage // tp_size,
        ep_size=ep_size,
        etp_size=etp_size,
        edp_size=stage // width,
        mp_mode=mp_mode,
    )


def expected_folding_group_tables(spec: ParallelFoldingSpec) -> FoldingGroupTables:
    """The four group tables of `spec` (see the module docstring for the layout); no process group is made."""
    tp: list[tuple[int, ...]] = []
    dense_dp: list[tuple[int, ...]] = []
    ep: list[tuple[int, ...]] = []
    edp: list[tuple[int, ...]] = []
    for first in range(0, spec.world_size, spec.stage_size):
        stage = tuple(range(first, first + spec.stage_size))
        tp += [stage[i : i + spec.tp_size] for i in range(0, spec.stage_size, spec.tp_size)]
        dense_dp += [stage[lane :: spec.tp_size] for lane in range(spec.tp_size)]
        stage_ep = [stage[i : i + spec.ep_size] for i in range(0, spec.stage_size, spec.ep_size)]
        ep += stage_ep
        edp += [tuple(group[pos] for group in stage_ep) for pos in range(spec.ep_size)]
    return FoldingGroupTables(tuple(tp), tuple(dense_dp), tuple(ep), tuple(edp))


def local_folding_ranks(global_rank: int, spec: ParallelFoldingSpec) -> dict[str, tuple[int, ...]]:
    """The groups `global_rank` belongs to: `{"tp": ..., "dense_dp": ..., "ep": ..., "edp": ...}`.

    Raises:
        ValueError: `global_rank` is outside the spec's world.
    """
    if not 0 <= global_rank < spec.world_size:
        raise ValueError(f"global_rank={global_rank} is outside world_size={spec.world_size}")
    tables = expected_folding_group_tables(spec)
    kinds = {"tp": tables.tp_groups, "dense_dp": tables.dense_dp_groups, "ep": tables.ep_groups}
    kinds["edp"] = tables.edp_groups
    return {kind: next(g for g in groups if global_rank in g) for kind, groups in kinds.items()}


def _mpu_size(mpu: Any, *getters: str) -> int | None:
    for name in getters:
        getter = getattr(mpu, name, None) if mpu is not None else None
        if getter is not None:
            return int(getter())
    return None


def validate_folding_global(
    spec: ParallelFoldingSpec,
    *,
    zero_stage: int = 0,
    sp_size: int = 1,
    deepcompile_enabled: bool = False,
    use_data_before_expert_parallel: bool = False,
    mpu: Any = None,
    autoep_enabled: bool = True,
    tp_preset: str | None = None,
    ep_preset: str | None = None,
    zero_offload_optimizer: bool = False,
    zero_offload_param: bool = False,
) -> None:
    """DeepSpeed 0.19.8's global rules for a folded layout, checked before any group exists.

    Raises:
        ValueError: a combination DeepSpeed refuses: DeepCompile, pipeline or Ulysses parallelism, ZeRO stage 3,
            ZeRO offload or
            `use_data_before_expert_parallel_` with folding; `expert_tensor_parallel_size` != 1; `autoep_size` 1 with
            AutoTP; the two `preset_model` keys disagreeing; an `mpu` whose TP or PP size disagrees.
    """
    if not autoep_enabled:
        return
    folded = spec.tp_size > 1
    if folded and deepcompile_enabled:
        raise ValueError(
            "DeepCompile with AutoEP+AutoTP folding is not supported; disable compile.deepcompile or set "
            "tensor_parallel.autotp_size=1"
        )
    if folded and spec.pp_size > 1:
        raise ValueError(f"AutoEP+AutoTP folding supports pp_size=1 only; got pp_size={spec.pp_size}")
    if folded and sp_size > 1:
        raise ValueError(
            "tensor_parallel.autotp_size and Ulysses sequence parallelism are mutually exclusive with AutoEP "
            f"(autotp_size={spec.tp_size}, sequence_parallel_size={sp_size})"
        )
    if spec.etp_size != 1:
        raise ValueError(
            f"expert_parallel.expert_tensor_parallel_size={spec.etp_size} is reserved for expert-internal tensor "
            "parallelism, which is not supported; use expert_tensor_parallel_size=1"
        )
    if tp_preset is not None and ep_preset is not None and tp_preset != ep_preset:
        raise ValueError(
            f"tensor_parallel.preset_model={tp_preset!r} and expert_parallel.preset_model={ep_preset!r} must match "
            "when both are set"
        )
    if folded and spec.ep_size == 1:
        raise ValueError(
            "AutoEP+AutoTP folding requires expert_parallel.autoep_size > 1 (with autoep_size=1 every TP lane would "
            "compute every routed token and their gradients would be counted tp_size times)"
        )
    if folded and use_data_before_expert_parallel:
        raise ValueError("use_data_before_expert_parallel_ is not supported with AutoEP+AutoTP folding; disable it")
    if folded and zero_stage == 3:
        raise ValueError(
            "AutoEP+AutoTP folding with ZeRO stage 3 (zero_optimization.stage=3) is not supported: DeepSpeed keeps "
            "it for a separate ZeRO-3 composition lane; use ZeRO stage 0, 1 or 2, or tensor_parallel.autotp_size=1"
        )
    if folded and (zero_offload_optimizer or zero_offload_param):
        raise ValueError(
            "ZeRO optimizer/parameter offload is not supported with AutoEP+AutoTP folding; disable "
            "zero_optimization.offload_optimizer / offload_param"
        )
    mpu_tp = _mpu_size(mpu, "get_tensor_model_parallel_world_size", "get_model_parallel_world_size")
    if mpu_tp not in (None, 1, spec.tp_size):
        raise ValueError(
            f"mpu tensor/model parallel world size ({mpu_tp}) conflicts with tensor_parallel.autotp_size={spec.tp_size}"
        )
    mpu_pp = _mpu_size(mpu, "get_pipeline_model_parallel_world_size", "get_pipeline_parallel_world_size")
    if mpu_pp not in (None, spec.pp_size):
        raise ValueError(f"mpu pipeline parallel world size ({mpu_pp}) conflicts with pp_size={spec.pp_size}")


def _as_groups(groups: Iterable[Iterable[int]]) -> set[tuple[int, ...]]:
    return {tuple(int(r) for r in g) for g in groups}


def assert_group_matches_spec(existing_rank_lists: Any, spec: ParallelFoldingSpec) -> None:
    """Check cached expert-parallel and expert-data-parallel rank lists against the layout `spec` expects.

    Args:
        existing_rank_lists: `(ep_groups, edp_groups)` or `{"ep": ..., "edp": ...}`, each a list of rank lists.

    Raises:
        RuntimeError: a cached group is not one of the spec's (a registry built for another layout).
    """
    if isinstance(existing_rank_lists, dict):
        seen_ep, seen_edp = existing_rank_lists.get("ep", ()), existing_rank_lists.get("edp", ())
    else:
        seen_ep, seen_edp = existing_rank_lists
    tables = expected_folding_group_tables(spec)
    for kind, seen, expected in (
        ("expert-parallel", seen_ep, tables.ep_groups),
        ("expert-data-parallel", seen_edp, tables.edp_groups),
    ):
        wanted = _as_groups(expected)
        for group in sorted(_as_groups(seen)):
            if group not in wanted:
                raise RuntimeError(f"cached {kind} group {group} does not match folding spec {spec}")
