"""Reading an AutoEP expert range that a save holds under other ranges (another expert-parallel degree).

An AutoEP layer stacks its local experts in one tensor, `[num_local_experts, ...]`, and ZeRO names it by the
experts it holds: `<prefix>.w1@experts{lo}:{hi}` (`ds_engine._step.moe`), so two expert-parallel ranks never
share a name. A save at `autoep_size` 2 of 4 experts holds `w1@experts0:2` and `w1@experts2:4`; a run at
`autoep_size` 1 asks for `w1@experts0:4`, one at 4 for `w1@experts3:4`. The ranges of one tensor are rows of the
same whole `[num_experts, ...]` tensor, and rows are contiguous in its flat layout: expert `e` is elements
`[e * row, (e + 1) * row)`. So a wanted range's element slice maps onto pieces of the saved ranges that cover
it, and the fp32 values and every optimizer state re-partition across expert-parallel degrees exactly as
across data-parallel ones (`FragmentIndex.copy_slice`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["ExpertRanges", "expert_range"]

_RANGE = re.compile(r"^(?P<base>.+)@experts(?P<lo>\d+):(?P<hi>\d+)$")


def expert_range(name: str) -> tuple[str, int, int] | None:
    """`(module name, first expert, end)` of a ZeRO name `<prefix>.w1@experts{lo}:{hi}`; None for another name."""
    m = _RANGE.match(name)
    return (m["base"], int(m["lo"]), int(m["hi"])) if m else None


@dataclass(frozen=True)
class _Saved:
    name: str
    lo: int
    hi: int
    row_shape: tuple[int, ...]


class ExpertRanges:
    """The saved expert ranges of every AutoEP expert tensor of one save, by the tensor's module name.

    Args:
        shapes: every saved parameter name -> its shape (`FragmentIndex.param_shapes`).
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]]) -> None:
        self._by_base: dict[str, list[_Saved]] = {}
        for name, shape in shapes.items():
            found = expert_range(name)
            if found is None or not shape or shape[0] != found[2] - found[1]:
                continue
            base, lo, hi = found
            self._by_base.setdefault(base, []).append(_Saved(name, lo, hi, tuple(shape[1:])))
        for saved in self._by_base.values():
            saved.sort(key=lambda s: s.lo)

    def _covering(self, name: str) -> tuple[list[_Saved], int, int, tuple[int, ...]] | None:
        found = expert_range(name)
        if found is None or found[1] >= found[2]:
            return None
        base, lo, hi = found
        saved = [s for s in self._by_base.get(base, []) if s.hi > lo and s.lo < hi]
        if not saved or len({s.row_shape for s in saved}) != 1:
            return None
        at = lo
        for s in saved:  # sorted by `lo`; the wanted rows must be covered without a gap
            if s.lo > at:
                return None
            at = max(at, s.hi)
        if at < hi:
            return None
        return saved, lo, hi, saved[0].row_shape

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The shape of expert range `name` when the saved ranges of its tensor cover its rows; else None."""
        covering = self._covering(name)
        if covering is None:
            return None
        _, lo, hi, row_shape = covering
        return (hi - lo, *row_shape)

    def pieces(self, name: str, start: int, numel: int) -> list[tuple[str, int, int, int]]:
        """Elements `[start, start + numel)` of expert range `name` as pieces of saved ranges: `(saved name,
        element start in it, offset in the wanted slice, length)`, in order; `[]` when `name` is not covered."""
        covering = self._covering(name)
        if covering is None:
            return []
        saved, lo, _, row_shape = covering
        row = math.prod(row_shape)
        want_lo = lo * row + start  # in the whole tensor's flat layout
        want_hi = want_lo + numel
        out = []
        for s in saved:
            piece_lo, piece_hi = max(want_lo, s.lo * row), min(want_hi, s.hi * row)
            if piece_lo < piece_hi:
                out.append((s.name, piece_lo - s.lo * row, piece_lo - want_lo, piece_hi - piece_lo))
        return out
