"""AutoEP folded with AutoTP at run time: the folded groups, and the routed experts' share of each TP lane.

With folding the dense layers run tensor-parallel and the routed experts expert-parallel over the same ranks
(`_folding` has the rank tables). The ranks of a tensor-parallel group hold the same tokens and route them
alike, so sending every assignment from every lane would run each one `tp_size` times. Instead each lane
keeps the assignments whose ordinal within their expert's run is `tp_rank` modulo `tp_size`, sends only
those through the expert all-to-all, and the lanes' results are all-gathered back so every lane holds every
routed row again.

Gradients stay exact and identical on the lanes, the invariant AutoTP keeps for replicated activations (its
column-parallel layers sum input gradients over the group):

- the gathered rows are the same on every lane and so is their gradient, so the gather's backward keeps this
  lane's rows without a reduction (the expert weights see each assignment's gradient once);
- the routing weights are combined on every lane from the lane's own (full) router output, so the router's
  gradient is whole everywhere;
- the MoE input (and, with `score_apply="pre"`, the routing weights) enter the experts through
  `copy_to_tp_region` (identity forward, sum over the group backward): each lane contributes the gradient of
  its own rows and the sum is the whole gradient.

So dense parameters, TP-cut or replicated, need only the data-parallel reduction, and an expert's gradient
is the sum over its expert-data-parallel group of the assignments each replica ran, divided by the number of
distinct batches (the dense data-parallel degree).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel.autoep._folding import (
    FoldingGroupHandles,
    ParallelFoldingSpec,
    assert_group_matches_spec,
    expected_folding_group_tables,
    local_folding_ranks,
)
from ds_parallel.autoep._tp_dispatch import assignment_ordinals_by_expert, digest_spread, gather_rows
from ds_parallel.tensor._regions import copy_to_tp_region

__all__ = ["check_lanes_routed_alike", "create_folding_groups", "folded_expert_rows"]


def create_folding_groups(
    spec: ParallelFoldingSpec, *, tp_group: ProcessGroup, dense_dp_group: ProcessGroup | None
) -> FoldingGroupHandles:
    """Register the folded expert-parallel and expert-data-parallel groups (`ep_size_{N}`) and return this rank's
    four groups. A collective (one `new_group` per table row) the first time; `tp_group` and `dense_dp_group` are
    the mesh's (their tables are the mesh's tensor-parallel and data-parallel groups).

    Raises:
        RuntimeError: `ep_size_{N}` is registered already with groups of another layout.
    """
    from ds_parallel.moe._groups import get_expert_groups, register_expert_groups

    tables = expected_folding_group_tables(spec)
    name = f"ep_size_{spec.ep_size}"
    try:
        known = get_expert_groups(name)
    except KeyError:
        known = None
    if known is not None:
        assert_group_matches_spec(([known.ep_ranks], [known.edp_ranks]), spec)
    groups = register_expert_groups(spec.ep_size, tables.ep_groups, tables.edp_groups)
    mine = local_folding_ranks(ds_comm.get_rank(), spec)
    for kind, group in (("tp", tp_group), ("dense_dp", dense_dp_group)):
        if group is None:  # one data-parallel replica: the engine keeps no group for it
            continue
        ranks = tuple(ds_comm.get_all_ranks_from_group(group))
        if ranks != mine[kind]:
            raise RuntimeError(f"AutoEP folding: this rank's {kind} group is {ranks}, the layout's {mine[kind]}")
    return FoldingGroupHandles(
        spec=spec,
        tp_group=tp_group,
        dense_dp_group=dense_dp_group,
        ep_group=groups.ep_group,
        edp_group=groups.edp_group,
        ep_group_name=name,
        tp_ranks=mine["tp"],
        dense_dp_ranks=mine["dense_dp"],
        ep_ranks=groups.ep_ranks,
        edp_ranks=groups.edp_ranks,
    )


class _GatherLaneRows(torch.autograd.Function):
    """All-gather of the lanes' rows; backward keeps this lane's rows of the (lane-identical) gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, counts: tuple[int, ...], rank: int) -> torch.Tensor:
        ctx.start, ctx.rows = sum(counts[:rank]), counts[rank]
        return gather_rows(x, group, list(counts))

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad.narrow(0, ctx.start, ctx.rows).contiguous(), None, None, None


_PRIME = 2_147_483_647


def check_lanes_routed_alike(
    experts: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor, group: ProcessGroup
) -> None:
    """Raise unless every lane of `group` routed alike (the same sorted experts, tokens and weights to 1e-6).

    Folding relies on it: each lane keeps its share of *its own* routing, so lanes that routed differently would
    drop some assignments and run others twice. DeepSpeed's `expert_parallel.validate_folding_routing` check.
    Collectives: two all_reduces (MAX and MIN) of a 4-word digest on `group`.

    Raises:
        RuntimeError: the digests differ (names both).
    """
    words = torch.cat([experts.long(), tokens.long(), weights.detach().double().mul(1e6).round().long().flatten()])
    position = torch.arange(1, words.numel() + 1, device=words.device, dtype=torch.long)
    digest = torch.stack(
        [
            torch.tensor(words.numel(), device=words.device),
            (words.remainder(_PRIME) * position).remainder(_PRIME).sum().remainder(_PRIME),
            (words.remainder(_PRIME) * position.square().remainder(_PRIME)).remainder(_PRIME).sum().remainder(_PRIME),
            words.sum(),
        ]
    )
    spread = digest_spread(digest, group)
    if spread is not None:
        raise RuntimeError(
            "AutoEP+AutoTP: the tensor-parallel lanes routed differently (routing digests "
            f"{spread[0]} .. {spread[1]}); each lane must see the same tokens (feed the same batch to the "
            "ranks of a tensor-parallel group)"
        )


def folded_expert_rows(
    layer: Any, x: torch.Tensor, weights: torch.Tensor, tokens: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """The routed experts' outputs for every expert-sorted assignment (`[T*k, H]`, same order as `tokens`),
    each run once over the lanes of `layer.tp_group` (see the module docstring).

    Args:
        layer: the `AutoEPMoELayer` (its `tp_group`/`tp_rank`/`tp_size`, `score_apply` and `_run_experts`).
        x: `[T, H]` the block's input, the same on every lane.
        weights: `[T*k, 1]` routing weights in the sorted order (applied here only for `score_apply="pre"`).
        tokens / experts: each sorted assignment's token and global expert.

    Collectives on the TP group: one all_gather of row counts and two of rows (results, positions); backward:
    the all-reduce of `copy_to_tp_region`; plus the expert exchange on the expert-parallel group.
    """
    group, size, rank = layer.tp_group, layer.tp_size, layer.tp_rank
    if layer.validate_folding_routing:
        check_lanes_routed_alike(experts, tokens, weights, group)
    keep = (assignment_ordinals_by_expert(experts).remainder(size) == rank).nonzero().flatten()
    grad = torch.is_grad_enabled()
    rows = copy_to_tp_region(x, group, grad).index_select(0, tokens.index_select(0, keep))
    if layer.score_apply == "pre":
        mine = copy_to_tp_region(weights, group, grad).index_select(0, keep)
        rows = (rows.float() * mine.float()).to(rows.dtype)
    counts = torch.bincount(experts.index_select(0, keep), minlength=layer.num_experts)
    done = layer._run_experts(rows, counts)
    mine_n = torch.tensor([keep.numel()], dtype=torch.long, device=x.device)
    lane_counts = [torch.zeros_like(mine_n) for _ in range(size)]
    ds_comm.all_gather(lane_counts, mine_n, group=group)
    sizes = tuple(int(c) for c in lane_counts)
    positions = gather_rows(keep, group, list(sizes))
    if done.requires_grad:
        gathered = _GatherLaneRows.apply(done, group, sizes, rank)
    else:
        gathered = gather_rows(done, group, list(sizes))
    return done.new_zeros((tokens.numel(), *done.shape[1:])).index_copy(0, positions, gathered)
