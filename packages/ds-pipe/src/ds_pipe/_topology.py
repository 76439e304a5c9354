"""Process topologies: a named Cartesian mesh of ranks (pipe x data x model) and rank <-> coordinate maps.

[Note: rank order] Ranks are laid out row-major over `axes`: the last axis varies fastest. With
`PipeDataParallelTopology(num_pp=2, num_dp=2)` (axes `pipe, data`) ranks 0 and 1 are stage 0 and
ranks 2 and 3 are stage 1, so data-parallel peers are neighbours. `PipeModelDataParallelTopology`
orders its axes `pipe, data, model` (model fastest, so tensor-parallel peers share a node) although
its arguments are `(num_pp, num_mp, num_dp)`: DeepSpeed's quirk, kept so layouts match.
"""

from __future__ import annotations

import itertools
import logging
from collections import namedtuple
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["PipeDataParallelTopology", "PipeModelDataParallelTopology", "ProcessTopology"]


class ProcessTopology:
    """A mesh of `prod(dims)` ranks with one named axis per dimension.

    Args:
        axes: axis names, outermost first (e.g. `["pipe", "data"]`); unique, non-empty strings.
        dims: the size of each axis, each >= 1.

    Raises:
        ValueError: axes and dims differ in length, an axis repeats, or a dim is < 1.
    """

    def __init__(self, axes: Sequence[str], dims: Sequence[int]) -> None:
        axes, dims = list(axes), list(dims)
        if len(axes) != len(dims):
            raise ValueError(f"ProcessTopology: axes {axes} and dims {dims} must have the same length")
        if not axes:
            raise ValueError("ProcessTopology: axes must name at least one axis (e.g. ['pipe', 'data'])")
        if len(set(axes)) != len(axes):
            raise ValueError(f"ProcessTopology: axis names must be unique, got {axes}")
        for axis, dim in zip(axes, dims, strict=True):
            if not isinstance(dim, int) or isinstance(dim, bool) or dim < 1:
                raise ValueError(f"ProcessTopology: dim of axis {axis!r} must be an int >= 1, got {dim!r}")
        self.axes: list[str] = axes
        self.dims: list[int] = dims
        self.ProcessCoord = namedtuple("ProcessCoord", axes)  # type: ignore[misc]
        self.mapping: dict[Any, int] = {}
        for rank, coord in enumerate(itertools.product(*(range(d) for d in dims))):
            self.mapping[self.ProcessCoord(*coord)] = rank
        self._coords = list(self.mapping)

    def world_size(self) -> int:
        """Number of ranks in the mesh (the product of the dims)."""
        return len(self._coords)

    def get_axis_names(self) -> list[str]:
        """The axis names, outermost first."""
        return list(self.axes)

    def get_dim(self, axis: str) -> int:
        """Size of `axis`, or 0 when the mesh has no such axis (DeepSpeed's convention)."""
        if axis not in self.axes:
            return 0
        return self.dims[self.axes.index(axis)]

    def get_rank(self, **coord_kwargs: int) -> int:
        """The rank at a full coordinate, e.g. `get_rank(pipe=1, data=0)`.

        Raises:
            ValueError: an axis is missing or unknown, or a coordinate is out of range.
        """
        if set(coord_kwargs) != set(self.axes):
            raise ValueError(f"get_rank needs exactly the axes {self.axes}, got {sorted(coord_kwargs)}")
        for axis, value in coord_kwargs.items():
            dim = self.get_dim(axis)
            if not 0 <= value < dim:
                raise ValueError(f"get_rank: {axis}={value} is out of range [0, {dim})")
        return self.mapping[self.ProcessCoord(**coord_kwargs)]

    def get_coord(self, rank: int) -> Any:
        """The `ProcessCoord` namedtuple of `rank` (fields named after the axes).

        Raises:
            ValueError: `rank` is outside `[0, world_size())`.
        """
        if not 0 <= rank < self.world_size():
            raise ValueError(f"get_coord: rank {rank} is out of range [0, {self.world_size()})")
        return self._coords[rank]

    def get_rank_repr(
        self, rank: int, omit_axes: Sequence[str] = ("data", "pipe"), inner_sep: str = "_", outer_sep: str = "-"
    ) -> str:
        """A file-name tag for `rank` from the axes not omitted, e.g. `model_01` (empty for pipe x data).

        Used in per-layer checkpoint names: `layer_03-model_01-model_states.pt`.
        """
        coord = self.get_coord(rank)
        parts = [f"{axis}{inner_sep}{getattr(coord, axis):02d}" for axis in self.axes if axis not in omit_axes]
        return outer_sep.join(parts)

    def get_axis_list(self, axis: str, idx: int) -> list[int]:
        """Ranks whose coordinate on `axis` is `idx`, ascending ([] when `axis` is not in the mesh)."""
        if axis not in self.axes:
            return []
        pos = self.axes.index(axis)
        return [rank for rank, coord in enumerate(self._coords) if coord[pos] == idx]

    def filter_match(self, **filter_kwargs: int) -> list[int]:
        """Ranks whose coordinates match every given `axis=value`, ascending.

        Raises:
            ValueError: an axis name is not in the mesh.
        """
        unknown = set(filter_kwargs) - set(self.axes)
        if unknown:
            raise ValueError(f"filter_match: unknown axes {sorted(unknown)}; the mesh has {self.axes}")
        return [
            rank
            for rank, coord in enumerate(self._coords)
            if all(getattr(coord, axis) == value for axis, value in filter_kwargs.items())
        ]

    def get_axis_comm_lists(self, axis: str) -> list[list[int]]:
        """The groups of ranks that communicate along `axis`: one list per fixed coordinate of the other axes.

        Each list holds the ranks that differ only in their `axis` coordinate, ordered by it; lists are
        ordered by the other axes' coordinates, outermost first. `[]` when `axis` is not in the mesh.
        """
        if axis not in self.axes:
            return []
        others = [a for a in self.axes if a != axis]
        lists = []
        for fixed in itertools.product(*(range(self.get_dim(a)) for a in others)):
            coord = dict(zip(others, fixed, strict=True))
            lists.append([self.get_rank(**coord, **{axis: i}) for i in range(self.get_dim(axis))])
        return lists

    def __str__(self) -> str:
        return f"{type(self).__name__}(axes={self.axes}, dims={self.dims})"

    __repr__ = __str__


class PipeDataParallelTopology(ProcessTopology):
    """Pipeline x data parallelism: axes `["pipe", "data"]`, dims `[num_pp, num_dp]`."""

    def __init__(self, num_pp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data"], dims=[num_pp, num_dp])


class PipeModelDataParallelTopology(ProcessTopology):
    """Pipeline x data x model (tensor) parallelism: axes `["pipe", "data", "model"]`.

    Note the argument order `(num_pp, num_mp, num_dp)` differs from the dims order
    `[num_pp, num_dp, num_mp]` (DeepSpeed's layout: model is the fastest-varying axis).
    """

    def __init__(self, num_pp: int, num_mp: int, num_dp: int) -> None:
        super().__init__(axes=["pipe", "data", "model"], dims=[num_pp, num_dp, num_mp])
