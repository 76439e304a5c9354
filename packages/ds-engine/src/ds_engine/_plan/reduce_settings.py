"""`ReduceSettings`: how stage-0 gradients are reduced across data-parallel ranks, decided from the config."""

from __future__ import annotations

import dataclasses

import torch

__all__ = ["ReduceSettings"]


@dataclasses.dataclass(frozen=True)
class ReduceSettings:
    """How stage-0 gradients are combined across data-parallel ranks (from the config, decided once)."""

    bucket_numel: int = 500_000_000
    average: bool = True
    """`gradient_allreduce_op`: mean (True) or sum (False)."""
    prescale: bool = False
    """`prescale_gradients`: divide by the world size before the all-reduce."""
    predivide: float = 1.0
    """`gradient_predivide_factor`."""
    comm_dtype: torch.dtype | None = None
    """`communication_data_type` (None: the buffer's dtype)."""

    def describe(self, world_size: int) -> str:
        op = "mean" if self.average else "sum"
        scale = "prescale" if self.prescale else f"postscale, predivide {self.predivide:g}"
        dtype = f", comm dtype {self.comm_dtype}" if self.comm_dtype is not None else ""
        return (
            f"bucketed all-reduce ({op} over {world_size} ranks, {scale}, "
            f"buckets of {self.bucket_numel} elements{dtype})"
        )
