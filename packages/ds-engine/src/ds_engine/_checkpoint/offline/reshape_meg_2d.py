"""`deepspeed.checkpoint.reshape_meg_2d`: which source model-parallel ranks each target (pp, tp) rank reads.

A checkpoint saved with pipeline degree P and tensor-parallel degree T has P*T model-parallel ranks,
numbered pp-major: rank `i` is stage `i // T`, tensor slice `i % T` (Megatron's and DeepSpeed's order,
and that of the `mp_rank_XX` files). Reading it at a smaller (P', T') merges ranks in two steps:

1. tensor parallelism first: within each stage, the T ranks (in slice order) are cut into T'
   contiguous runs, so target slice j of a stage reads source slices j*T/T' .. (j+1)*T/T' - 1;
2. then pipeline parallelism: within each target slice, the runs of the P stages (in stage order)
   are concatenated and cut into P' contiguous runs, so target stage s reads stages s*P/P' onward.

Each target (pp, tp) cell ends up with the ordered list of source ranks whose shards it concatenates.
Only contraction is possible (a target degree may not exceed the source's) and each target degree must
divide the source's, so every target rank reads whole, equally many source ranks.
"""

from __future__ import annotations

from ds_engine._checkpoint.offline.reshape_utils import partition_data

__all__ = ["meg_2d_parallel_map", "reshape_meg_2d_parallel"]


class meg_2d_parallel_map:  # noqa: N801 - DeepSpeed's class name
    """A pp_degree x tp_degree grid whose cells hold lists of source indices (ranks or file indices)."""

    def __init__(self, pp_degree: int, tp_degree: int) -> None:
        if pp_degree < 1 or tp_degree < 1:
            raise ValueError(f"meg_2d_parallel_map: pp_degree {pp_degree} and tp_degree {tp_degree} must be >= 1")
        self.pp_degree = pp_degree
        self.tp_degree = tp_degree
        self.map: dict[tuple[int, int], list[int]] = {}

    def simple_init(self) -> None:
        """The identity layout: cell (pp, tp) holds the one rank `pp * tp_degree + tp`."""
        self.map = {(i // self.tp_degree, i % self.tp_degree): [i] for i in range(self.pp_degree * self.tp_degree)}

    def add_data(self, pp_index: int, tp_index: int, data: list[int]) -> None:
        """Append `data` to cell (pp_index, tp_index)."""
        self._validate_indices(pp_index, tp_index)
        if not isinstance(data, list):
            raise TypeError(f"meg_2d_parallel_map.add_data: data must be a list, got {type(data).__name__}")
        self.map.setdefault((pp_index, tp_index), []).extend(data)

    def get_data(self, pp_index: int | None = None, tp_index: int | None = None) -> list[int]:
        """The indices of one cell; None for an index takes every row (or column), pp-major."""
        self._validate_indices(pp_index, tp_index)
        rows = range(self.pp_degree) if pp_index is None else [pp_index]
        cols = range(self.tp_degree) if tp_index is None else [tp_index]
        return [idx for i in rows for j in cols for idx in self.map.get((i, j), [])]

    def print_data(self, tag: str) -> None:
        """Print the grid, one cell a line, under `tag` (a debugging aid, as DeepSpeed's)."""
        print(tag)
        for (i, j), value in sorted(self.map.items()):
            print(f"{i},{j} = {value}")

    def _validate_indices(self, pp_index: int | None, tp_index: int | None) -> None:
        if pp_index is not None and not 0 <= pp_index < self.pp_degree:
            raise IndexError(f"pp_index {pp_index} outside pp_degree {self.pp_degree}")
        if tp_index is not None and not 0 <= tp_index < self.tp_degree:
            raise IndexError(f"tp_index {tp_index} outside tp_degree {self.tp_degree}")

    def __repr__(self) -> str:
        return f"meg_2d_parallel_map(pp_degree={self.pp_degree}, tp_degree={self.tp_degree}, map={self.map})"


def _check_contraction(name: str, old: int, new: int) -> None:
    if new < 1 or new > old or old % new:
        raise ValueError(f"cannot reshape {name} degree {old} -> {new}: the target must be >= 1 and divide the source")


def reshape_meg_2d_parallel(
    old_pp_degree: int, old_tp_degree: int, new_pp_degree: int, new_tp_degree: int, verbose: bool = False
) -> meg_2d_parallel_map:
    """The new_pp x new_tp grid of source model-parallel ranks each target rank reads (see the module note).

    Raises:
        ValueError: a target degree is larger than, or does not divide, the source degree.
    """
    _check_contraction("pp", old_pp_degree, new_pp_degree)
    _check_contraction("tp", old_tp_degree, new_tp_degree)
    grid = meg_2d_parallel_map(old_pp_degree, old_tp_degree)
    grid.simple_init()
    if verbose:
        grid.print_data("source 2d map:")

    tp_merged = meg_2d_parallel_map(old_pp_degree, new_tp_degree)
    for stage in range(old_pp_degree):
        runs = partition_data(grid.get_data(pp_index=stage), new_tp_degree)
        for tp_index, run in enumerate(runs):
            tp_merged.add_data(stage, tp_index, run)
    if verbose:
        tp_merged.print_data("after the tp contraction:")

    result = meg_2d_parallel_map(new_pp_degree, new_tp_degree)
    for tp_index in range(new_tp_degree):
        runs = partition_data(tp_merged.get_data(tp_index=tp_index), new_pp_degree)
        for stage, run in enumerate(runs):
            result.add_data(stage, tp_index, run)
    if verbose:
        result.print_data("target 2d map:")
    return result
