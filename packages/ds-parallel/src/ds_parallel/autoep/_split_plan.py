"""The split plan of an expert-parallel exchange: how many rows go to and come from each rank, per local expert.

Each rank counts its assignments per global expert (`[E]`, int32) and sends them in ONE `all_to_all_single` on
the expert-parallel group: rank r receives, from every source, the counts for r's own `E_local` experts, as
a `[ep_size, E_local]` matrix. Everything else follows without another collective: the send splits are this
rank's counts summed per destination, the receive splits are the matrix's row sums, and the rows each local
expert will see are its column sums.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

import ds_comm

__all__ = ["SplitPlan", "compute_split_plan", "compute_split_plan_from_expert_indices", "count_tokens_per_expert"]


def count_tokens_per_expert(selected_experts_indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """`[num_experts]` int32: how many of the (token, expert) choices name each expert.

    A scatter-add into a buffer of known size, so (unlike `torch.bincount`) no device sync sizes the output.
    """
    flat = selected_experts_indices.reshape(-1).long()
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))


class SplitPlan(NamedTuple):
    """One rank's view of an expert-parallel exchange."""

    input_splits: list[int]
    """Rows sent to each expert-parallel rank (`ep_size` entries)."""
    output_splits: list[int]
    """Rows received from each expert-parallel rank."""
    local_counts: torch.Tensor
    """`[E_local]`: rows each local expert receives in all."""
    local_counts_by_source: torch.Tensor
    """`[ep_size, E_local]`: rows each source rank sends to each local expert."""


def _plan_from_counts(counts: torch.Tensor, ep_size: int, num_local_experts: int, ep_group: Any) -> SplitPlan:
    counts = counts.to(torch.int32).contiguous()
    if ep_size == 1:
        total = int(counts.sum())
        return SplitPlan([total], [total], counts, counts.view(1, num_local_experts))
    received = torch.empty_like(counts)
    ds_comm.all_to_all_single(received, counts, group=ep_group)
    by_source = received.view(ep_size, num_local_experts)
    send = counts.view(ep_size, num_local_experts).sum(1).tolist()
    return SplitPlan(send, by_source.sum(1).tolist(), by_source.sum(0), by_source)


def compute_split_plan(
    selected_experts: torch.Tensor,
    num_experts: int,
    ep_size: int,
    num_local_experts: int,
    ep_group: Any,
    num_tokens_per_expert: torch.Tensor | None = None,
) -> SplitPlan:
    """The plan for routing `selected_experts` (`[T, k]` or flat global expert ids).

    Args:
        num_tokens_per_expert: the `[E]` histogram when the caller already has it (the router's).

    Collectives: one `all_to_all_single` of `E` int32 counts on `ep_group` when `ep_size` > 1, none otherwise.

    Raises:
        ValueError: `num_experts` is not `ep_size * num_local_experts`.
    """
    if num_experts != ep_size * num_local_experts:
        raise ValueError(
            f"num_experts={num_experts} must equal ep_size={ep_size} * num_local_experts={num_local_experts}"
        )
    if num_tokens_per_expert is None:
        num_tokens_per_expert = count_tokens_per_expert(selected_experts, num_experts)
    return _plan_from_counts(num_tokens_per_expert, ep_size, num_local_experts, ep_group)


def compute_split_plan_from_expert_indices(
    expert_indices: torch.Tensor, num_experts: int, ep_size: int, num_local_experts: int, ep_group: Any
) -> SplitPlan:
    """The plan for an already partitioned (folded) assignment list of global expert ids; as `compute_split_plan`."""
    return compute_split_plan(expert_indices, num_experts, ep_size, num_local_experts, ep_group)
