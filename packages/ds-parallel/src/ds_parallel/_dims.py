"""`ParallelDims`: the degrees of each kind of parallelism, checked against the world size before any group exists."""

from __future__ import annotations

import dataclasses

__all__ = ["MESH_DIM_NAMES", "ParallelDims"]

#: The mesh's dimensions, outermost first. `edp` x `ep` is the data-parallel dimension `dp` (experts are
#: sharded over the inner `ep` ranks of each data-parallel group, as DeepSpeed lays expert groups out);
#: `sp` sits inside `dp` so an SP group is consecutive ranks; `tp` is innermost (fastest links).
MESH_DIM_NAMES: tuple[str, ...] = ("pp", "edp", "ep", "sp", "tp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """How `world_size` ranks split into pipeline, data, expert, sequence and tensor parallelism.

    `pp * dp * sp * tp == world_size`; `ep` divides `dp` (expert parallelism reuses data-parallel ranks).
    `dp=-1` takes whatever the other degrees leave.
    """

    world_size: int
    """Total ranks."""
    pp: int = 1
    """Pipeline stages."""
    dp: int = -1
    """Data-parallel replicas (-1: world_size / (pp * sp * tp))."""
    ep: int = 1
    """Expert-parallel degree, a divisor of dp."""
    sp: int = 1
    """Sequence-parallel (Ulysses) degree."""
    tp: int = 1
    """Tensor-parallel degree."""

    def __post_init__(self) -> None:
        for name in ("world_size", "pp", "ep", "sp", "tp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ParallelDims: {name} must be a positive int, got {value!r}")
        if not isinstance(self.dp, int) or isinstance(self.dp, bool) or (self.dp < 1 and self.dp != -1):
            raise ValueError(f"ParallelDims: dp must be a positive int or -1 (the rest), got {self.dp!r}")
        others = self.pp * self.sp * self.tp
        if self.dp == -1:
            if self.world_size % others:
                raise ValueError(
                    f"ParallelDims: world_size {self.world_size} is not divisible by "
                    f"pp({self.pp}) * sp({self.sp}) * tp({self.tp}) = {others}"
                )
            object.__setattr__(self, "dp", self.world_size // others)
        if self.pp * self.dp * self.sp * self.tp != self.world_size:
            raise ValueError(
                f"ParallelDims: pp({self.pp}) * dp({self.dp}) * sp({self.sp}) * tp({self.tp}) = "
                f"{self.pp * self.dp * self.sp * self.tp} != world_size {self.world_size}"
            )
        if self.dp % self.ep:
            raise ValueError(
                f"ParallelDims: ep({self.ep}) must divide dp({self.dp}): expert parallelism splits "
                "each data-parallel group"
            )

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Sizes of `MESH_DIM_NAMES`, in that order."""
        return (self.pp, self.dp // self.ep, self.ep, self.sp, self.tp)

    @property
    def sp_enabled(self) -> bool:
        return self.sp > 1
