"""Which ranks form the expert-parallel and expert-data-parallel groups: DeepSpeed's rank layouts as lists.

Four layouts, all computed without any process group (every rank derives the same lists, then creates
every group in the same order):

- E + D (the default): inside each pipeline stage, `ep_size` consecutive ranks exchange tokens; the
  ranks at the same position of those blocks replicate the same experts (their expert-data-parallel
  group). With a tensor-parallel model and experts that are not tensor-parallel this is still the layout
  (DeepSpeed ignores tensor parallelism here): tensor-parallel peers hold identical tokens, each keeps a
  1/tp slice of every expert's capacity, so whatever group exchanges them, every expert sees every token
  slice exactly once.
- D + E (`use_data_before_expert_parallel_`): the stage splits into `ep_size` blocks of consecutive ranks,
  each block one expert-data-parallel group; an expert-parallel group takes one rank per block (stride).
- E + M + D and D + M + E (expert tensor parallelism): the experts are themselves tensor-parallel, so the
  groups are formed inside each tensor-parallel lane (the data-parallel ranks at one tensor-parallel
  index), with the E + D or D + E rule applied to the lane.
"""

from __future__ import annotations

__all__ = ["expert_rank_lists"]


def _check(world_size: int, ep_size: int, tp_size: int, pp_size: int) -> None:
    if min(world_size, ep_size, tp_size, pp_size) < 1:
        raise ValueError(
            f"sizes must be >= 1: world_size={world_size}, expert_parallel_size={ep_size}, "
            f"tensor_parallel_size={tp_size}, pipeline_parallel_size={pp_size}"
        )
    if world_size % (tp_size * pp_size):
        raise ValueError(
            f"world_size {world_size} is not divisible by tensor_parallel_size {tp_size} x "
            f"pipeline_parallel_size {pp_size}"
        )


def _split(ranks: list[int], ep_size: int, data_before_expert: bool) -> tuple[list[list[int]], list[list[int]]]:
    """One stage's (or lane's) ranks into expert-parallel and expert-data-parallel groups."""
    if len(ranks) % ep_size:
        raise ValueError(
            f"expert_parallel_size {ep_size} does not divide the {len(ranks)} ranks it splits ({ranks}); "
            "choose an ep_size that divides the data-parallel world"
        )
    replicas = len(ranks) // ep_size
    if data_before_expert:
        edp = [ranks[i * replicas : (i + 1) * replicas] for i in range(ep_size)]
        ep = [ranks[i::replicas] for i in range(replicas)]
    else:
        ep = [ranks[i * ep_size : (i + 1) * ep_size] for i in range(replicas)]
        edp = [ranks[i::ep_size] for i in range(ep_size)]
    return ep, edp


def expert_rank_lists(
    world_size: int,
    ep_size: int,
    *,
    tp_size: int = 1,
    pp_size: int = 1,
    expert_tensor_parallel: bool = False,
    data_before_expert: bool = False,
) -> tuple[list[list[int]], list[list[int]]]:
    """`(expert_parallel_groups, expert_data_parallel_groups)` for a world laid out tensor-parallel
    fastest, then data-parallel, then pipeline stage (see the module docstring for the rule of each layout).

    World 8, ep 2: E + D gives `[0,1] [2,3] [4,5] [6,7]` / `[0,2,4,6] [1,3,5,7]`; D + E gives
    `[0,4] [1,5] [2,6] [3,7]` / `[0,1,2,3] [4,5,6,7]`. With tp 2 and expert tensor parallelism, E + M + D
    gives `[0,2] [4,6] [1,3] [5,7]` / `[0,4] [2,6] [1,5] [3,7]`.

    Raises:
        ValueError: a size does not divide what it splits (the values named).
    """
    _check(world_size, ep_size, tp_size, pp_size)
    stage = world_size // pp_size
    lanes = tp_size if expert_tensor_parallel else 1
    ep_groups: list[list[int]] = []
    edp_groups: list[list[int]] = []
    for start in range(0, world_size, stage):
        for lane in range(lanes):
            ep, edp = _split(list(range(start + lane, start + stage, lanes)), ep_size, data_before_expert)
            ep_groups += ep
            edp_groups += edp
    return ep_groups, edp_groups
