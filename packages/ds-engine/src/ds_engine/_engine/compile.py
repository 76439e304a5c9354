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
`ds_zero._compile.selective`). At stages 1/2 the module is compiled with ds-zero's stage-1/2 backend
(`ds_zero._compile.reduce_backend`, DeepSpeed's `zero1_compile`/`zero2_compile`): each parameter's
gradient is handed to ZeRO's reducer by an op placed right after the node producing it in the backward
graph (stage 2 reduce-scatters its buckets during the backward, stage 1 reduces at the accumulation
boundary, as eagerly), and the reducer's eager hooks leave those parameters alone; a graph break gives
them back to the hooks, with the same warning as at stage 3. At stage 0 DeepCompile is a plain
`torch.compile`.

`compile(compiled_autograd_enabled=True)` without DeepCompile wraps each `engine.backward` in torch's compiled
autograd, as DeepSpeed does: the backward's autograd graph, ZeRO's gradient hooks included, is captured and
compiled with the same backend and `compile_kwargs`, at ZeRO stages 0 and 1; at stages 2 and 3 it is refused
naming the stage (their gradient hooks queue autograd callbacks, which Dynamo captures only in one full graph).
With DeepCompile it is ignored with a warning (DeepSpeed logs the same: DeepCompile compiles the backward).

`engine.compile(schedule=...)` takes DeepSpeed's pass schedule, `[(global_step, [pass, ...]), ...]`, with
its pass names or callables (`deepspeed.compile.passes.*`): it is checked against DeepSpeed's pass
contracts and ds's rules at `compile()` (`_plan.compile_schedule`, which says what each pass means in ds
and which are refused), and at the first training forward of each listed step the DeepCompile settings
change to that step's passes and the module is compiled again where the graphs change (`prefetch` on or
off, parameters kept whole by `selective_gather`). `engine.register_compile_pass(name, fn, contract)`
registers a pass and its contract, which take part in the validation; a schedule that lists a user pass
is refused, since ds cannot give it DeepSpeed's graph internals (see COMPATIBILITY.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from ds_comm import get_accelerator
from ds_engine._optional import require
from ds_engine._plan.compile_schedule import CompileStep, default_schedule, plan_schedule
from ds_engine._plan.pass_contracts import PassContract, register_compile_pass

logger = logging.getLogger(__name__)

__all__ = ["EngineCompile"]

#: engine.compile(backend=...) values DeepCompile's stage-3 backend can compile its graphs with
_DC_INNER = {"inductor": "inductor", "eager": "eager", "aot_eager": "eager"}


@dataclasses.dataclass
class _StepRecord:
    """A schedule step that began: the first graph number compiled under it, selective unsharding's choice."""

    step: CompileStep
    first_graph: int
    unshard_plan: Any = None


def _dc_inner(backend: str, kwargs: dict[str, Any], *, stage: int) -> str:
    """How DeepCompile's backends compile their graphs for `engine.compile(backend=...)` ("inductor" or "eager").

    Raises:
        ValueError: a backend DeepCompile's graphs cannot go through (names the choices).
    """
    inner = _DC_INNER.get(backend)
    if inner is None:
        raise ValueError(
            f"engine.compile(backend={backend!r}): DeepCompile at ZeRO stage {stage} compiles its graphs with "
            f"one of {sorted(_DC_INNER)}"
        )
    if kwargs.get("fullgraph") is False:
        logger.warning("engine.compile: DeepCompile captures the whole forward; fullgraph=False is overridden")
    return inner


class EngineCompile:
    """Mixed into `DeepSpeedEngine`."""

    module: nn.Module
    _is_compiled: bool = False
    _compile_kwargs: dict[str, Any] | None = None
    _dc_backend: Any = None
    _dc_pause: contextlib.ExitStack | None = None
    _dc_kwargs: dict[str, Any] | None = None  # what the module was compiled with, for the recompile
    _dc_unshard_plan: Any = None  # selective unsharding's latest choice
    _dc_pending: list[CompileStep] | None = None  # the schedule's steps not begun yet
    _dc_history: list[_StepRecord] | None = None  # the steps begun, in order
    _dc_reduces: bool = False  # ZeRO-1/2: the backend places gradient reductions (no gathers, no later steps)
    _autograd_compiler: Callable[..., Any] | None = None  # compiled autograd's compiler, when it is on

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Sequence[tuple[int, Sequence[str | Callable[..., Any]]]] | None = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """`torch.compile` the wrapped module in place (DeepCompile when `compile.deepcompile` is on).

        A second call is a no-op, as in DeepSpeed. Nothing is compiled until the first forward.

        Args:
            backend: a torch.compile backend (default: the accelerator's, "inductor"). With DeepCompile at
                stages 1-3: "inductor", or "eager"/"aot_eager" (the scheduled graphs run as Python).
            compile_kwargs: other `torch.compile` keyword arguments (`mode`, `dynamic`, `fullgraph`...);
                a `backend` inside it is overridden by `backend`, with a warning.
            schedule: DeepSpeed's pass schedule `[(global_step, [pass name or callable, ...]), ...]`, with
                `compile.deepcompile` on (without it the schedule has no effect, with a warning). None: at
                stage 3 `prefetch` from step 0 and `selective_gather` after 5 warm-up steps; at stages 1/2
                the stage's pass. What each pass does in ds: `ds_engine._plan.compile_schedule`.
            compiled_autograd_enabled: capture each `engine.backward`'s autograd graph and compile it with
                `backend` and `compile_kwargs` (torch's compiled autograd), at ZeRO stages 0 and 1. With
                DeepCompile, which compiles the backward itself, it is ignored with a warning, as in DeepSpeed.

        Raises:
            ValueError: compiled autograd at ZeRO stage 2 or 3 without DeepCompile (their gradient hooks queue
                autograd callbacks, which it cannot capture); a backend DeepCompile cannot use; `compile.passes`
                naming a pass for another ZeRO stage; a schedule ds refuses (naming the step and the pass;
                `PassContractError` for a broken pass contract).
            TypeError: `compile_kwargs` is not a dict; `schedule` is not a list of (int, list) pairs.
        """
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
        if compiled_autograd_enabled and not settings.deepcompile and stage >= 2:
            raise ValueError(
                f"engine.compile(compiled_autograd_enabled=True) with zero_optimization.stage={stage}: ZeRO's gradient "
                "hooks at stages 2 and 3 schedule their collectives from autograd callbacks, which compiled autograd "
                "cannot capture; it works at stages 0 and 1 (or use compile.deepcompile, which compiles the backward)"
            )
        steps: tuple[CompileStep, ...] | None = None
        if settings.deepcompile:
            self._check_passes(settings.passes, stage)
            if schedule is not None:
                steps = plan_schedule(schedule, stage=stage)
                if settings.passes is not None:
                    warnings.warn(
                        f"compile.passes={settings.passes!r} has no effect: engine.compile(schedule=...) names the "
                        "passes",
                        UserWarning,
                        stacklevel=2,
                    )
        elif schedule is not None:
            warnings.warn(
                "engine.compile(schedule=...) has no effect without compile.deepcompile: true (the module is "
                "compiled with torch.compile)",
                UserWarning,
                stacklevel=2,
            )
        if settings.deepcompile and stage == 3:
            self._deepcompile_zero3(chosen, dict(kwargs), debug_log=settings.debug_log, steps=steps)
        elif settings.deepcompile and stage in (1, 2):
            self._deepcompile_zero12(chosen, dict(kwargs), stage, debug_log=settings.debug_log, steps=steps)
        else:
            logger.info("engine.compile: torch.compile of the module with backend=%s %s", chosen, kwargs)
            self.module.compile(**{**kwargs, "backend": chosen})
        self._is_compiled = True
        self._compile_kwargs = dict(kwargs)
        if compiled_autograd_enabled and settings.deepcompile:
            warnings.warn(
                "engine.compile(compiled_autograd_enabled=True) is ignored: DeepCompile (compile.deepcompile) compiles "
                "the backward itself, and compiled autograd does not combine with it (DeepSpeed ignores it too)",
                UserWarning,
                stacklevel=2,
            )
        elif compiled_autograd_enabled:
            self._autograd_compiler = torch.compile(backend=chosen, **kwargs)
            logger.info("engine.compile: compiled autograd on, each backward compiled with backend=%s", chosen)

    def _compiled_backward(self) -> contextlib.AbstractContextManager[Any]:
        """Compiled autograd around `engine.backward` when `compile(compiled_autograd_enabled=True)` turned it on:
        the backward's autograd graph (ZeRO's gradient hooks included) is captured and compiled; nothing
        otherwise, nor inside a graph Dynamo is tracing."""
        if self._autograd_compiler is None or torch.compiler.is_compiling():
            return contextlib.nullcontext()
        from torch._dynamo import compiled_autograd

        return compiled_autograd._enable(self._autograd_compiler)

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

    def register_compile_pass(
        self, pass_name: str, pass_fn: Callable[..., Any], contract: PassContract | None = None
    ) -> None:
        """Register `pass_fn` as DeepCompile pass `pass_name` with `contract` (None clears an earlier one).

        The registry is process-wide, as DeepSpeed's. The contract takes part in checking every schedule;
        a schedule that lists the pass is refused at `compile()`, since ds cannot run a pass written
        against DeepSpeed's graph internals (see `ds_engine._plan.compile_schedule`).

        Raises:
            TypeError: `pass_name` is not a non-empty string or `pass_fn` is not callable.
        """
        register_compile_pass(pass_name, pass_fn, contract)

    def _deepcompile_zero3(
        self, backend: str, kwargs: dict[str, Any], *, debug_log: bool, steps: tuple[CompileStep, ...] | None
    ) -> None:
        inner = _dc_inner(backend, kwargs, stage=3)
        dc = require("ds_zero._compile.backend", extra="zero", feature="DeepCompile at ZeRO stage 3")
        stage3: Any = getattr(self.module, "_ds_zero3", None)
        if stage3 is None:
            raise RuntimeError("engine.compile: DeepCompile at ZeRO stage 3 found no partitioned module")
        selective = require("ds_zero._compile.selective", extra="zero", feature="DeepCompile at ZeRO stage 3")
        steps = steps if steps is not None else default_schedule(3, selective.WARMUP_STEPS)
        first, *later = steps
        self._dc_backend = dc.DeepCompileBackend(self.module, inner=inner, overlap=_overlap(first), debug_log=debug_log)
        self._dc_pause = contextlib.ExitStack()
        self._dc_pause.enter_context(stage3.hooks_paused())
        logger.info("engine.compile: DeepCompile (ZeRO-3 gathers and releases in the graph), backend=%s", backend)
        self._dc_kwargs = {**kwargs, "fullgraph": True}
        self._dc_history = [_StepRecord(first, 0)]
        self._dc_pending = list(later)
        self.module.compile(**{**self._dc_kwargs, "backend": self._dc_backend})

    def _deepcompile_zero12(
        self,
        backend: str,
        kwargs: dict[str, Any],
        stage: int,
        *,
        debug_log: bool,
        steps: tuple[CompileStep, ...] | None,
    ) -> None:
        """Compile with ds-zero's stage-1/2 backend: each gradient's hand-over to ZeRO's reducer is placed in the
        backward graph (`ds_zero._compile.reduce_backend`). Every schedule step means the same graphs at these
        stages (`zero1_compile` and `zero2_compile` alike), so the module is compiled once."""
        inner = _dc_inner(backend, kwargs, stage=stage)
        feature = f"DeepCompile at ZeRO stage {stage}"
        dc = require("ds_zero._compile.reduce_backend", extra="zero", feature=feature)
        sink = self.optimizer.graph_gradients()  # type: ignore[attr-defined]
        steps = steps if steps is not None else default_schedule(stage)
        self._dc_reduces = True
        self._dc_backend = dc.ReduceGradBackend(self.module, sink, inner=inner, debug_log=debug_log)
        # the graphs hand their parameters' gradients over themselves; falling back gives them to the hooks
        self._dc_pause = contextlib.ExitStack()
        self._dc_pause.callback(sink.take_back_from_graph)
        logger.info("engine.compile: DeepCompile (ZeRO-%d gradient reduction in the graph), backend=%s", stage, backend)
        self._dc_kwargs = {**kwargs, "fullgraph": True}
        self._dc_history = [_StepRecord(step, 0) for step in steps]
        self._dc_pending = []
        self.module.compile(**{**self._dc_kwargs, "backend": self._dc_backend})

    def _begin_step(self, step: CompileStep) -> None:
        """Put `step`'s passes in force (at a training forward: selective unsharding is a collective) and
        compile the module again where its graphs change; the same passes again compile nothing new."""
        backend = self._dc_backend
        record = _StepRecord(step, backend.graph_count)
        assert self._dc_history is not None
        self._dc_history.append(record)
        logger.info("DeepCompile: global step %d, passes %s", step.step, list(step.passes))
        recompile = None
        if step.unshard:
            recompile = self._unshard_selectively(record)
        if _overlap(step) != backend.overlap:
            recompile = backend.with_overlap(_overlap(step))
        if recompile is not None:
            self.module.compile(**{**(self._dc_kwargs or {}), "backend": recompile})

    def _unshard_selectively(self, record: _StepRecord) -> Callable[..., Any] | None:
        """Selective unsharding at the start of `record`'s step (collectives); the backend to compile the module
        with again when parameters were kept whole, else None."""
        selective = require("ds_zero._compile.selective", extra="zero", feature="DeepCompile at ZeRO stage 3")
        stage3: Any = self.module._ds_zero3
        gathered = self._dc_backend.param_names
        candidates = [(name, p) for name, p in self.module.named_parameters() if getattr(p, "ds_id", None) in gathered]
        headroom = selective.agreed_headroom(selective.memory_headroom())
        chosen, plan = selective.choose_whole(candidates, headroom)
        self._dc_unshard_plan = record.unshard_plan = plan
        log = logger.info if self._ds_config.parsed.compile.debug_log else logger.debug  # type: ignore[attr-defined]
        log("DeepCompile %s", plan.line())
        if not chosen:
            return None
        params = [p for _, p in chosen]
        selective.keep_whole(stage3, params)
        return self._dc_backend.stop_gathering(params)  # type: ignore[no-any-return]

    def _call_module(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the wrapped module; DeepCompile meeting a graph break falls back to the eager hooks here."""
        if self._dc_pause is None:
            return self.module(*inputs, **kwargs)
        # at a training forward (every rank runs it; an evaluation under no_grad may run on some ranks only)
        while (
            self._dc_pending
            and self.global_steps >= self._dc_pending[0].step  # type: ignore[attr-defined]
            and torch.is_grad_enabled()
        ):
            self._begin_step(self._dc_pending.pop(0))
        import torch._dynamo.exc as dynamo_exc

        try:
            return self.module(*inputs, **kwargs)
        except (dynamo_exc.Unsupported, dynamo_exc.UserError, dynamo_exc.FailOnRecompileLimitHit) as err:
            where = str(err).strip()
            stage = self.zero_optimization_stage()  # type: ignore[attr-defined]
            warnings.warn(
                f"DeepCompile: the forward does not capture as one graph, so ZeRO-{stage} runs with its eager "
                f"hooks instead: {where}",
                RuntimeWarning,
                stacklevel=3,
            )
            logger.warning("DeepCompile fell back to eager ZeRO-%d: %s", stage, where)
            self._dc_pause.close()
            self._dc_pause = None
            self._dc_backend = None
            self._dc_pending = self._dc_history = None
            self.module._compiled_call_impl = None
            return self.module(*inputs, **kwargs)

    @property
    def deepcompile_schedule(self) -> list[str]:
        """ZeRO-3: per schedule step begun, `step N: <passes>`, then the gathers and releases placed in each
        graph compiled under it, then selective unsharding's choice when the step made one. ZeRO-1/2: every
        step's line (the same graphs serve them all), then per backward graph its gradient reductions, each
        with the node it follows. Empty before `compile()` and after a fall-back to the eager hooks."""
        if self._dc_history is None or self._dc_backend is None:
            return []
        if self._dc_reduces:  # stages 1/2: every step the same graphs
            lines = [record.step.line() for record in self._dc_history]
            return lines + self._dc_backend.schedule.lines()  # type: ignore[no-any-return]
        lines = []
        history = self._dc_history
        for i, record in enumerate(history):
            end = history[i + 1].first_graph if i + 1 < len(history) else None
            lines.append(record.step.line())
            lines += self._dc_backend.schedule.lines(record.first_graph, end)
            if record.unshard_plan is not None:
                lines.append(record.unshard_plan.line())
        return lines

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` was called (DeepSpeed's property)."""
        return self._is_compiled


def _overlap(step: CompileStep) -> int | None:
    """ds-zero's `overlap` for `step`: one bucket ahead with `prefetch`, else blocking gathers in place."""
    return 1 if step.prefetch else None
