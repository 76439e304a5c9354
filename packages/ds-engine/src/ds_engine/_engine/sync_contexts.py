"""`engine.no_sync()` and `engine.coalesce_grad_reduction()`: blocks of backwards whose reduction waits.

Both mark the engine as inside a no-sync context (`inside_no_sync_ctxt`), where `step()` is refused and
neither may open inside the other (DeepSpeed shares one flag between them, so a nested exit would clear
the outer block's). `no_sync()` is DeepSpeed's stage 0/1 context: in ds those stages reduce in `step()`
anyway, so it only marks the block. `coalesce_grad_reduction()` is for the stages that reduce during
backward: the ZeRO optimizer keeps the block's gradients on the parameters and reduces them once when the
block exits (`ds_zero`'s `coalesce_grad_reduction`, see its note).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import ds_comm
from ds_engine._step.steppers import ZeroStepper

if TYPE_CHECKING:
    from ds_engine.config import ZeroSettings

__all__ = ["EngineSyncContexts"]


class EngineSyncContexts:
    """Mixed into `DeepSpeedEngine`: DeepSpeed's `no_sync` and `coalesce_grad_reduction` contexts."""

    _stepper: Any
    _zero_settings: ZeroSettings
    _managed: bool
    _in_no_sync: bool
    _sync_context: str = "no_sync"
    pipeline_parallelism: bool

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside skip gradient reduction (at stages 0 and 1 reduction happens in step() anyway).

        Raises:
            ds_comm.UsageError: under ZeRO stage 2/3 (gradients are reduced during backward; use
                `coalesce_grad_reduction()`), or inside another no-sync block. Also an AssertionError,
                as DeepSpeed asserts these.
        """
        if self._zero_settings.stage >= 2:
            raise ds_comm.UsageError(
                f"no_sync context manager is incompatible with ZeRO stage {self._zero_settings.stage}, which reduces "
                "gradients during backward; use engine.coalesce_grad_reduction() to reduce several backwards "
                "at once"
            )
        self._refuse_nesting("no_sync")
        with self._marked("no_sync"):
            yield

    @contextlib.contextmanager
    def coalesce_grad_reduction(self) -> Iterator[None]:
        """One optimizer step's backwards, their gradients reduced once, when the block exits.

        Run every backward of the step inside (marking the last with `set_gradient_accumulation_boundary`
        as usual), then `step()` after the block. Under ZeRO 1-3 the optimizer keeps each gradient on its
        parameter, where the next backward adds to it, and the exit reduces the sums in one pass over the
        data-parallel group (every rank must leave its block); the update equals the one N separately
        reduced backwards give, up to the order of additions. At stage 0 the reduction happens once in
        `step()` anyway, so the block only marks the backwards. One block per step: the exit's reduction
        ends the accumulation window.

        Raises:
            ds_comm.UsageError: `managed_gradient_accumulation` is false, or the block would nest with
                `no_sync()` or itself (also an AssertionError, as DeepSpeed asserts these).
            NotImplementedError: under pipeline parallelism (the pipeline schedule runs its own backwards).
        """
        if not self._managed:
            raise ds_comm.UsageError(
                "coalesce_grad_reduction() needs managed_gradient_accumulation=true: with it false the "
                "caller owns the accumulation boundary and every step() is one"
            )
        if self.pipeline_parallelism:
            raise NotImplementedError(
                "coalesce_grad_reduction is not supported under pipeline parallelism: the pipeline "
                "schedule drives its own backwards (use train_batch())"
            )
        self._refuse_nesting("coalesce_grad_reduction")
        optimizer = self._stepper.optimizer if isinstance(self._stepper, ZeroStepper) else None
        with self._marked("coalesce_grad_reduction"):
            if optimizer is None:
                yield
            else:
                with optimizer.coalesce_grad_reduction():
                    yield

    def _refuse_nesting(self, name: str) -> None:
        if self._in_no_sync:
            raise ds_comm.UsageError(
                f"engine.{name}() inside engine.{self._sync_context}(): no_sync context manager reentry is "
                "unsupported (both are no_sync contexts and cannot be nested)"
            )

    @contextlib.contextmanager
    def _marked(self, name: str) -> Iterator[None]:
        self._in_no_sync, self._sync_context = True, name
        try:
            yield
        finally:
            self._in_no_sync = False

    def _refuse_step_in_sync_context(self) -> None:
        if self._in_no_sync:
            raise ds_comm.UsageError(
                f"It is illegal to call Engine.step() inside no_sync context manager (here "
                f"engine.{self._sync_context}()): call it after the with-block"
            )
