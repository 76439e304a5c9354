"""`coalesce_grad_reduction()`: several backwards per step, their gradients reduced once, at the end.

[Note: why defer] A step fed by N backwards (chunks of a batch too big for one forward, with
`set_gradient_accumulation_boundary` marking the last) normally reduces at every backward at stages 2
and 3: N rounds of reduce-scatters for one update. Inside the context the reducers' hooks leave each
gradient on its parameter, where autograd adds the next backward's; leaving the context reduces the
sums in one pass, bucket by bucket in the fixed order every rank uses. The result equals N reductions
up to the order of additions (sum, then reduce, instead of reduce, then sum). Stage 1 reduces only at
`step()` in ds anyway, so there the context only moves that single reduction to the exit.

What it costs: between the backwards every trainable parameter holds a full gradient in its own dtype
(stage 3 included), as DeepSpeed's does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

import ds_comm

__all__ = ["CoalescedReduction", "DeferrableReducer"]


class DeferrableReducer(Protocol):
    """What each stage's gradient reducer offers for deferral."""

    deferred: bool

    def reduce_deferred(self) -> None: ...


class CoalescedReduction:
    """Mixed into the ZeRO optimizers: `coalesce_grad_reduction()` and the guard `step()` runs."""

    coalescing_grad_reduction: bool = False
    """Whether a `coalesce_grad_reduction()` block is open (its backwards' gradients not reduced yet)."""

    def _deferrable_reducer(self) -> DeferrableReducer:
        raise NotImplementedError  # each optimizer names its reducer

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """Backwards inside keep their gradients on the parameters; the exit reduces them all in one pass.

        One block per optimizer step: run the step's backwards inside, then `step()` after the block.
        The exit issues the reduction collectives (every rank of the data-parallel group must leave its
        block); after it the gradients are where one backward leaves them. If the block raises, nothing is
        reduced (a collective now could pair with another one on a rank that did not fail) and the
        gradients stay on the parameters until `zero_grad()`.

        Raises:
            ds_comm.UsageError: a block is already open (also an AssertionError, as DeepSpeed asserts).
        """
        if self.coalescing_grad_reduction:
            raise ds_comm.UsageError("coalesce_grad_reduction() is already open: nested blocks are not supported")
        reducer = self._deferrable_reducer()
        self.coalescing_grad_reduction = True
        reducer.deferred = True
        try:
            yield
        finally:
            reducer.deferred = False
            self.coalescing_grad_reduction = False
        reducer.reduce_deferred()

    def _refuse_step_while_coalescing(self) -> None:
        if self.coalescing_grad_reduction:
            raise ds_comm.UsageError(
                "step() inside coalesce_grad_reduction(): the block's gradients are reduced when it exits; "
                "call step() after the with-block"
            )
