"""Which columns of each weight ZenFlow updates at once: the top `topk_ratio` by gradient magnitude.

A weight of shape (rows, columns) is ranked column by column (a column of `nn.Linear.weight` is one input
feature), by the sum of the absolute values of its averaged gradient. DeepSpeed 0.19.8 stores each weight
transposed (column after column) in its flat buffer and ranks the columns of each rank's partition
separately: a partition holds the columns wholly inside it, ranks them, and picks
`max(1, int(topk_ratio * its whole columns))` of them (none when it holds no whole column); a column cut
by a partition boundary is never selected.
`ColumnPlan` reproduces exactly that choice from the whole averaged gradient (which every ds rank holds),
so a run selects the same columns as DeepSpeed's at the same world size. The partitions are DeepSpeed's:
the group's element count padded to a multiple of `2 * world` (its 4-byte start alignment for 16-bit
elements), split evenly.

At ZeRO-3 (`stage3_columns`) DeepSpeed partitions each weight on its own, transposed, in `ceil(numel /
world)` pieces; again only the columns wholly inside one rank's piece can be chosen, but the top
`max(1, int(topk_ratio * all those columns))` are ranked across the pieces of the weight together (its
ranks all-gather their column sums), not piece by piece. `ParamColumns.select_from_sums` makes either
choice from the per-column sums, so the ZeRO-3 glue, which holds only partial sums, can reuse it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["ColumnPlan", "ParamColumns", "stage3_columns"]

#: DeepSpeed's `nccl_start_alignment_factor` (stage 1/2 flat buffers are padded to a multiple of it x world).
_ALIGNMENT = 2


@dataclass(frozen=True)
class ParamColumns:
    """One parameter's pieces: `(start_column, end_column, num_select)` per partition piece, in order.

    A 1-D parameter has no pieces: it is updated whole every step. With `num_select_total` set (ZeRO-3),
    that many columns are chosen among all the pieces' columns together and the pieces' own counts are
    unused.
    """

    shape: tuple[int, ...]
    pieces: tuple[tuple[int, int, int], ...]
    num_select_total: int | None = None

    @property
    def is_matrix(self) -> bool:
        return len(self.shape) == 2

    @property
    def num_selected(self) -> int:
        return sum(k for _, _, k in self.pieces)

    def select(self, grad: torch.Tensor) -> torch.Tensor:
        """The sorted indices of the selected columns of `grad` (the averaged gradient, this parameter's shape)."""
        rows = self.shape[0]
        by_column = grad.detach().t().contiguous().view(-1, rows)  # DeepSpeed's transposed layout
        return self.select_from_sums(by_column.abs().sum(dim=1))

    def select_from_sums(self, sums: torch.Tensor) -> torch.Tensor:
        """The sorted indices of the selected columns, given each column's sum of |gradient| (`sums`, 1-D)."""
        if self.num_select_total is not None:
            eligible = [torch.arange(start, end, device=sums.device) for start, end, _ in self.pieces if end > start]
            if not eligible or self.num_select_total <= 0:
                return torch.zeros(0, dtype=torch.long, device=sums.device)
            columns = torch.cat(eligible)
            top = torch.topk(sums.index_select(0, columns), self.num_select_total).indices
            return columns.index_select(0, top).sort().values.to(torch.long)
        chosen = []
        for start, end, k in self.pieces:
            if k <= 0:
                continue
            top = torch.topk(sums[start:end], k).indices + start
            chosen.append(top.sort().values)
        if not chosen:
            return torch.zeros(0, dtype=torch.long, device=sums.device)
        return torch.cat(chosen).to(torch.long)


class ColumnPlan:
    """The partition pieces of every parameter of one ZeRO param group (see the module note).

    Args:
        shapes: the group's trainable parameters' shapes, in flat-buffer order.
        world_size: the data-parallel world size the group is partitioned over.
        topk_ratio: share of each piece's whole columns to select.

    Raises:
        ValueError: a parameter with more than 2 dimensions (ZenFlow ranks columns of matrices only).
    """

    def __init__(self, shapes: list[tuple[int, ...]], world_size: int, topk_ratio: float, names: list[str]) -> None:
        numel = sum(_numel(s) for s in shapes)
        align = _ALIGNMENT * world_size
        partition = (-(-numel // align) * align) // world_size if numel else 0
        self.params: list[ParamColumns] = []
        offset = 0
        for shape, name in zip(shapes, names, strict=True):
            n = _numel(shape)
            if len(shape) > 2:
                raise ValueError(
                    f"zero_optimization.zenflow: parameter {name!r} has shape {tuple(shape)}; ZenFlow selects "
                    "columns of 1-D and 2-D parameters only (reshape it to 2-D or freeze it)"
                )
            pieces: list[tuple[int, int, int]] = []
            if len(shape) == 2 and n:
                rows = shape[0]
                first, last = offset // partition, (offset + n - 1) // partition
                for r in range(first, last + 1):
                    lo = max(r * partition - offset, 0)
                    hi = min((r + 1) * partition - offset, n)
                    start = -(-lo // rows)
                    end = hi // rows
                    cols = max(end - start, 0)
                    pieces.append((start, start + cols, max(1, int(cols * topk_ratio)) if cols else 0))
            self.params.append(ParamColumns(tuple(shape), tuple(pieces)))
            offset += n


def stage3_columns(shape: tuple[int, ...], world_size: int, topk_ratio: float, name: str) -> ParamColumns:
    """DeepSpeed's ZeRO-3 choice for one parameter (module note): its transposed flat cut in `world_size`
    pieces of `ceil(numel / world_size)` elements; per piece the whole columns in it; one top-k over them all.

    Raises:
        ValueError: a parameter with more than 2 dimensions.
    """
    if len(shape) > 2:
        raise ValueError(
            f"zero_optimization.zenflow: parameter {name!r} has shape {tuple(shape)}; ZenFlow selects "
            "columns of 1-D and 2-D parameters only (reshape it to 2-D or freeze it)"
        )
    n = _numel(shape)
    if len(shape) != 2 or not n:
        return ParamColumns(tuple(shape), ())
    rows = shape[0]
    piece = -(-n // world_size)
    pieces = []
    for r in range(world_size):
        lo, hi = r * piece, min((r + 1) * piece, n)
        if lo >= n:
            break
        start, end = -(-lo // rows), hi // rows
        pieces.append((start, max(start, end), 0))
    total = sum(end - start for start, end, _ in pieces)
    return ParamColumns(tuple(shape), tuple(pieces), max(1, int(total * topk_ratio)) if total else 0)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
