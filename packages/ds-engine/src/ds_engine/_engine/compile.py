"""`engine.compile()` / `engine.is_compiled`: torch.compile of the wrapped module, at any ZeRO stage.

DeepSpeed compiles the wrapped module in place (`module.compile(backend=...)`), so the engine, its
hooks and its state dict keep their shape; ds does the same. The engine's own work (loss scaling,
gradient reduction, the optimizer step) stays eager; at ZeRO stage 3 the gather/release hooks run
around the compiled forward. DeepSpeed's DeepCompile passes (`schedule`) and compiled autograd are
not implemented and are refused by name.
"""

from __future__ import annotations

import logging
from typing import Any

from torch import nn

from ds_comm import get_accelerator

logger = logging.getLogger(__name__)

__all__ = ["EngineCompile"]


class EngineCompile:
    """Mixed into `DeepSpeedEngine`."""

    module: nn.Module
    _is_compiled: bool = False
    _compile_kwargs: dict[str, Any] | None = None

    def compile(
        self,
        backend: str | None = None,
        compile_kwargs: dict[str, Any] | None = None,
        schedule: Any = None,
        compiled_autograd_enabled: bool = False,
    ) -> None:
        """`torch.compile` the wrapped module in place; later forwards run the compiled graph.

        A second call is a no-op, as in DeepSpeed. Nothing is compiled until the first forward.

        Args:
            backend: a torch.compile backend (default: the accelerator's, "inductor").
            compile_kwargs: other `torch.compile` keyword arguments (`mode`, `dynamic`, `fullgraph`...);
                a `backend` inside it is overridden by `backend`, with a warning.
            schedule: DeepCompile's pass schedule; not supported (ValueError unless None).
            compiled_autograd_enabled: DeepSpeed's compiled autograd; not supported (ValueError if True).

        Raises:
            ValueError: `schedule` or `compiled_autograd_enabled` given.
            TypeError: `compile_kwargs` is not a dict.
        """
        if schedule is not None:
            raise ValueError("engine.compile(schedule=...): DeepCompile schedules are not implemented in ds")
        if compiled_autograd_enabled:
            raise ValueError(
                "engine.compile(compiled_autograd_enabled=True): compiled autograd is not implemented in ds"
            )
        kwargs = {} if compile_kwargs is None else compile_kwargs
        if not isinstance(kwargs, dict):
            raise TypeError(f"engine.compile(compile_kwargs=...): expected a dict, got {type(kwargs).__name__}")
        if self._is_compiled:
            return
        if "backend" in kwargs:
            logger.warning("engine.compile: the `backend` in compile_kwargs is overridden; use the backend argument")
        chosen = backend if backend is not None else get_accelerator().get_compile_backend()
        logger.info("engine.compile: torch.compile of the module with backend=%s %s", chosen, kwargs)
        self.module.compile(**{**kwargs, "backend": chosen})
        self._is_compiled = True
        self._compile_kwargs = dict(kwargs)

    @property
    def is_compiled(self) -> bool:
        """Whether `compile()` was called (DeepSpeed's property)."""
        return self._is_compiled
