"""`engine.compile()` / `engine.is_compiled`: torch.compile of the wrapped module, or DeepCompile.

Without `compile.deepcompile`, DeepSpeed compiles the wrapped module in place (`module.compile(backend=...)`),
so the engine, its hooks and its state dict keep their shape; ds does the same, and at ZeRO stage 3 the
gather/release hooks run around the compiled forward.

With `compile.deepcompile: true` at ZeRO stage 3 the module's gather/release hooks are paused and the
module is compiled with ds-zero's DeepCompile backend, which places each parameter's all-gather and
release inside the forward and backward graphs (see `ds_zero._compile`). The whole forward must be one
graph: where Dynamo meets a graph break the engine warns, naming the place, and goes back to the eager
hooks for good. After DeepSpeed's 5 warm-up steps the engine keeps whole the partitioned parameters that
fit in the memory the warm-up left unused and recompiles without their gathers (selective unsharding,
`ds_zero._compile.selective`). At stages 0-2 DeepCompile compiles the forward and backward with the
chosen backend and gradient reduction stays with ZeRO's eager per-parameter hooks. DeepSpeed's custom
pass schedules and compiled autograd are refused by name.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from typing import Any

import torch
from torch import nn

from ds_comm import get_accelerator
from ds_engine._optional import require

logger = logging.getLogger(__name__)

__all__ = ["EngineCompile"]

#: engine.compile(backend=...) values DeepCompile's stage-3 backend can compile its graphs with
_DC_INNER = {"inductor": "inductor", "eager": "eager", "aot_eager": "eager"}


class EngineCompile:
    """Mixed into `DeepSpeedEngine`."""

    module: nn.Module
    _is_compiled: bool = False
    _compile_kwargs: dict[str, Any] | None = None
    _dc_backend: Any = None
    _dc_pause: contextlib.ExitStack | None = None
    _dc_kwargs: dict[str, Any] | None = None  # what the module was compiled with, for the recompile
    _dc_unshard_plan: Any = None  # selective unsharding's choice, once made
    _dc_unshard_after: int | None = None  # the optimizer steps before it is made

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """`torch.compile` the wrapped module in place (DeepCompile when `compile.deepcompile` is on).

        A second call is a no-op, as in DeepSpeed. Nothing is compiled until the first forward.

        Args:
            backend: a torch.compile backend (default: the accelerator's, "inductor"). With DeepCompile at
                stage 3: "inductor", or "eager"/"aot_eager" (the scheduled graphs run as Python).
            compile_kwargs: other `torch.compile` keyword arguments (`mode`, `dynamic`, `fullgraph`...);
                a `backend` inside it is overridden by `backend`, with a warning.
            schedule: DeepSpeed's custom pass schedule; only None (ds runs the ZeRO stage's passes, or
                `compile.passes`).
            compiled_autograd_enabled: DeepSpeed's compiled autograd; only False (DeepCompile's backward is
                compiled through AOTAutograd).

        Raises:
            ValueError: `schedule` or `compiled_autograd_enabled` given; a backend DeepCompile cannot use;
                `compile.passes` naming a pass for another ZeRO stage.
            TypeError: `compile_kwargs` is not a dict.
        """
        if schedule is not None:
            raise ValueError(
                "engine.compile(schedule=...): custom DeepCompile pass schedules are not supported in ds; "
                "DeepCompile runs the ZeRO stage's passes (see the compile.passes key)"
            )
        if compiled_autograd_enabled:
            raise ValueError(
                "engine.compile(compiled_autograd_enabled=True): compiled autograd is not supported in ds; "
                "DeepCompile compiles the backward through AOTAutograd already"
            )
        kwargs = {} if compile_kwargs is None else compile_kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"engine.compile(compile_kwargs=...): expected a dict, got {type(kwargs).__name__}")
        if self._is_compiled:
            return
        if "backend" in kwargs:
            logger.warning("engine.compile: the `backend` in compile_kwargs is overridden; use the backend argument")
        chosen = backend if backend is not None else get_accelerator().get_compile_backend()
        settings = self._ds_config.parsed.compile  # type: ignore[attr-defined]
        stage = self.zero_optimization_stage()  # type: ignore[attr-defined]
        if settings.deepcompile:
            self._check_passes(settings.passes, stage)
        if settings.deepcompile and stage == 3:
            self._deepcompile_zero3(chosen, dict(kwargs), debug_log=settings.debug_log)
        else:
            logger.info("engine.compile: torch.compile of the module with backend=%s %s", chosen, kwargs)
            self.module.compile(**{**kwargs, "backend": chosen})
        self._is_compiled = True
        self._compile_kwargs = dict(kwargs)

    @staticmethod
    def _check_passes(passes: list[str] | None, stage: int) -> None:
        if passes is None:
            return
        want = "z3" if stage == 3 else "z1"
        wrong = [p for p in passes if p != want]
        if wrong:
            raise ValueError(
                f"compile.passes={passes!r}: the {wrong[0]!r} pass does not apply at zero_optimization.stage="
                f"{stage}; use [{want!r}] or leave compile.passes unset"
            )

    def _deepcompile_zero3(self, backend: str, kwargs: dict[str, Any], *, debug_log: bool) -> None:
        inner = _DC_INNER.get(backend)
        if inner is None:
            raise ValueError(
                f"engine.compile(backend={backend!r}): DeepCompile at ZeRO stage 3 compiles its graphs with "
                f"one of {sorted(_DC_INNER)}"
            )
        if kwargs.get("fullgraph") is False:
            logger.warning("engine.compile: DeepCompile captures the whole forward; fullgraph=False is overridden")
        dc = require("ds_zero._compile.backend", extra="zero", feature="DeepCompile at ZeRO stage 3")
        stage3: Any = getattr(self.module, "_ds_zero3", None)
        if stage3 is None:
            raise RuntimeError("engine.compile: DeepCompile at ZeRO stage 3 found no partitioned module")
        self._dc_backend = dc.DeepCompileBackend(self.module, inner=inner, debug_log=debug_log)
        self._dc_pause = contextlib.ExitStack()
        self._dc_pause.enter_context(stage3.hooks_paused())
        logger.info("engine.compile: DeepCompile (ZeRO-3 gathers and releases in the graph), backend=%s", backend)
        self._dc_kwargs = {**kwargs, "fullgraph": True}
        self._dc_unshard_after = require(
            "ds_zero._compile.selective", extra="zero", feature="DeepCompile at ZeRO stage 3"
        ).WARMUP_STEPS
        self.module.compile(**{**self._dc_kwargs, "backend": self._dc_backend})

    def _unshard_selectively(self) -> None:
        """Selective unsharding, once, at the first training forward after the warm-up steps (collectives)."""
        selective = require("ds_zero._compile.selective", extra="zero", feature="DeepCompile at ZeRO stage 3")
        stage3: Any = self.module._ds_zero3
        gathered = self._dc_backend.param_names
        candidates = [(name, p) for name, p in self.module.named_parameters() if getattr(p, "ds_id", None) in gathered]
        headroom = selective.agreed_headroom(selective.memory_headroom())
        chosen, plan = selective.choose_whole(candidates, headroom)
        self._dc_unshard_plan = plan
        log = logger.info if self._ds_config.parsed.compile.debug_log else logger.debug  # type: ignore[attr-defined]
        log("DeepCompile %s", plan.line())
        if chosen:
            params = [p for _, p in chosen]
            selective.keep_whole(stage3, params)
            self.module.compile(**{**(self._dc_kwargs or {}), "backend": self._dc_backend.stop_gathering(params)})

    def _call_module(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; DeepCompile meeting a graph break falls back to the eager hooks here."""
        if self._dc_pause is None:
            return self.module(*inputs, **kwargs)
        # at a training forward (every rank runs it; an evaluation under no_grad may run on some ranks only)
        if (
            self._dc_unshard_after is not None
            and self.global_steps >= self._dc_unshard_after  # type: ignore[attr-defined]
            and torch.is_grad_enabled()
        ):
            self._dc_unshard_after = None
            self._unshard_selectively()
        import torch._dynamo.exc as dynamo_exc

        try:
            return self.module(*inputs, **kwargs)
        except (dynamo_exc.Unsupported, dynamo_exc.UserError, dynamo_exc.FailOnRecompileLimitHit) as err:
            where = str(err).strip()
            warnings.warn(
                f"DeepCompile: the forward does not capture as one graph, so ZeRO-3 runs with its eager "
                f"hooks instead: {where}",
                RuntimeWarning,
                stacklevel=3,
            )
            logger.warning("DeepCompile fell back to eager ZeRO-3: %s", where)
            self._dc_pause.close()
            self._dc_pause = None
            self._dc_backend = None
            self.module._compiled_call_impl = None
            return self.module(*inputs, **kwargs)

    @property
    def deepcompile_schedule(self) -> list[str]:
        """The gathers and releases DeepCompile placed, per compiled graph (empty before the first step),
        then selective unsharding's choice once it is made."""
        if self._dc_backend is None:
            return []
        plan = [] if self._dc_unshard_plan is None else [self._dc_unshard_plan.line()]
        return [*self._dc_backend.schedule.lines(), *plan]

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` was called (DeepSpeed's property)."""
        return self._is_compiled
