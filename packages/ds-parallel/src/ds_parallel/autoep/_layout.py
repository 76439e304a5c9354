"""Which way round a fused gate+up expert tensor is stored, read from the two tensors' shapes alone.

Hugging Face stores a block's experts as one fused gate+up tensor `w1` and one down tensor `w2`, in one of two
orientations: `[E, 2F, H]` with down `[E, H, F]` (the `nn.Linear` orientation, "gate_up_first"), or
`[E, H, 2F]` with down `[E, F, H]` (the matmul orientation, "hidden_first", which must be transposed into the
Linear orientation AutoEP's experts use). The gate is the first half of the 2F axis, the up projection the
second. Square or odd shapes are ambiguous or wrong and are not guessed at.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

__all__ = ["FusedExpertLayout", "classify_fused_gate_up_layout"]


@dataclasses.dataclass(frozen=True)
class FusedExpertLayout:
    """The orientation of a fused gate+up tensor and the sizes it implies."""

    layout: Literal["gate_up_first", "hidden_first"]
    hidden_size: int
    ffn_hidden_size: int
    needs_transpose: bool
    """True when the tensors are in the matmul orientation and must be transposed into `[E, out, in]`."""


def classify_fused_gate_up_layout(w1_shape: Sequence[int], w2_shape: Sequence[int]) -> FusedExpertLayout | None:
    """The layout of fused gate+up `w1` and down `w2` from their shapes, or None when neither orientation fits.

    Both must be 3-D (`[num_experts, ...]`); the fused axis must be even and the down tensor's two inner dims
    must be exactly (hidden, ffn) of the same orientation.
    """
    w1, w2 = tuple(int(d) for d in w1_shape), tuple(int(d) for d in w2_shape)
    if len(w1) != 3 or len(w2) != 3:
        return None
    _, a, b = w1
    if a % 2 == 0 and w2[1:] == (b, a // 2):
        return FusedExpertLayout("gate_up_first", hidden_size=b, ffn_hidden_size=a // 2, needs_transpose=False)
    if b % 2 == 0 and w2[1:] == (b // 2, a):
        return FusedExpertLayout("hidden_first", hidden_size=a, ffn_hidden_size=b // 2, needs_transpose=True)
    return None
