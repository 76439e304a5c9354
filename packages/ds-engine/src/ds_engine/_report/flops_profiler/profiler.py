"""`FlopsProfiler` and `get_model_profile`: params, MACs, flops and forward latency per module.

DeepSpeed's API and module path (`deepspeed.profiling.flops_profiler.profiler`). Counting is a
torch dispatch mode (see `_counter.py` for why); each module keeps its own numbers in the
attributes DeepSpeed uses (`__flops__`, `__macs__`, `__params__`, `__duration__`) between
`start_profile()` and `end_profile()`, so `get_module_flops(module)` and friends work on any
submodule. Latency is wall time between a module's forward pre-hook and forward hook, the device
synchronized at both ends.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ds_engine._report.flops_profiler.counter import OpCounter, model_params, warm_up_dispatch
from ds_engine._report.flops_profiler.report import (
    Totals,
    aggregated_lines,
    detailed_lines,
    summary_value,
)
from ds_engine._report.flops_profiler.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

logger = logging.getLogger(__name__)

__all__ = ["FlopsProfiler", "get_model_profile", "get_module_duration", "get_module_flops", "get_module_macs"]

_ATTRS = ("__flops__", "__macs__", "__params__", "__duration__")


def get_module_flops(module: nn.Module) -> int:
    """Forward flops of `module` and its submodules in the current profile."""
    return sum(getattr(m, "__flops__", 0) for m in module.modules())


def get_module_macs(module: nn.Module) -> int:
    """Forward MACs of `module` and its submodules in the current profile."""
    return sum(getattr(m, "__macs__", 0) for m in module.modules())


def get_module_duration(module: nn.Module) -> float:
    """Forward seconds of `module`; a container that never ran forward itself (ModuleList) sums its children."""
    own = float(getattr(module, "__duration__", 0.0))
    if own == 0:
        return sum(get_module_duration(child) for child in module.children())
    return own


def _params_of(module: nn.Module) -> int:
    return int(getattr(module, "__params__", 0))


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


class FlopsProfiler:
    """Profiles the forward pass of `model`: per-module parameters, MACs, flops and latency.

    Usage: `start_profile()`, run forward(s), read `get_total_flops()` etc. or
    `print_model_profile()`, then `end_profile()`. Between `start_profile()` and `stop_profile()`
    every forward adds up; `start_profile()` starts from zero.

    Args:
        model: the module to profile.
        ds_engine: the engine, when the engine drives the profile (adds batch and parallel sizes and
            the backward and step latencies to the summary).
        recompute_fwd_factor: forward recomputations per backward (activation checkpointing), for the
            estimated backward flops `(2 + factor) * forward flops` printed next to the measured ones.
    """

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"FlopsProfiler needs a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = float(recompute_fwd_factor)
        self.started = False
        self.flops = self.macs = self.params = 0
        self.backward_flops = self.backward_macs = 0
        """Flops and MACs of the ops run inside `count_backward()` since `start_profile()`."""
        self.latencies: dict[str, float] = {}
        """Seconds of `fwd`, `bwd`, `step` of the profiled step (set by the engine)."""
        self._stack: list[nn.Module] = []
        self._starts: list[float] = []
        self._handles: list[Any] = []
        self._counter: OpCounter | None = None
        self._counting = False

    # -- lifecycle ---------------------------------------------------------------------------------
    def start_profile(self, ignore_list: Sequence[type] | None = None) -> None:
        """Reset the counts and start counting (hooks on every module whose type is not in `ignore_list`;
        an ignored module's work is charged to its parent)."""
        self.stop_profile()
        warm_up_dispatch()
        self.reset_profile()
        ignored = tuple(ignore_list or ())
        for module in self.model.modules():
            if ignored and isinstance(module, ignored):
                continue
            self._handles.append(module.register_forward_pre_hook(self._enter))
            self._handles.append(module.register_forward_hook(self._exit, always_call=True))
        self._counter = OpCounter(self._stack, self._add, self._add_backward)
        self._counter.start()
        self._counting = True
        self.started = True
        logger.info("flops profiler started")

    def pause(self) -> None:
        """Stop counting ops until `count_backward()` (the hooks stay; forward counts stay readable)."""
        if self._counter is not None and self._counting:
            self._counter.stop()
            self._counting = False

    def stop_profile(self) -> None:
        """Stop counting; the counts stay readable until `end_profile()`."""
        if self._counter is not None:
            self.pause()
            self._counter = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._stack.clear()
        self._starts.clear()

    def reset_profile(self) -> None:
        """Zero every module's counts (parameters are counted again)."""
        for module in self.model.modules():
            module.__flops__ = 0  # type: ignore[assignment]
            module.__macs__ = 0  # type: ignore[assignment]
            module.__params__ = model_params(module)  # type: ignore[assignment]
            module.__duration__ = 0.0  # type: ignore[assignment]
        self.backward_flops = self.backward_macs = 0
        self.latencies = {}

    def end_profile(self) -> None:
        """Stop counting and remove the profile attributes from the modules."""
        if not self.started:
            return
        self.stop_profile()
        for module in self.model.modules():
            for attr in _ATTRS:
                if attr in module.__dict__:
                    delattr(module, attr)
        self.started = False
        logger.info("flops profiler finished")

    @contextlib.contextmanager
    def count_backward(self) -> Iterator[None]:
        """Charge the ops run inside to the backward totals (the engine wraps its backward in this)."""
        counter = self._counter
        if counter is None:
            yield
            return
        entered = not self._counting
        if entered:
            counter.start()
            self._counting = True
        counter.backward = True
        try:
            yield
        finally:
            counter.backward = False
            if entered:
                counter.stop()
                self._counting = False

    # -- hooks -------------------------------------------------------------------------------------
    def _enter(self, module: nn.Module, args: Any) -> None:
        _synchronize()
        self._stack.append(module)
        self._starts.append(time.perf_counter())

    def _exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._stack or self._stack[-1] is not module:
            return
        _synchronize()
        self._stack.pop()
        module.__duration__ = getattr(module, "__duration__", 0.0) + time.perf_counter() - self._starts.pop()  # type: ignore[assignment]

    def _add_backward(self, flops: int, macs: int) -> None:
        self.backward_flops += flops
        self.backward_macs += macs

    @staticmethod
    def _add(module: nn.Module, flops: int, macs: int) -> None:
        module.__flops__ = getattr(module, "__flops__", 0) + flops  # type: ignore[assignment]
        module.__macs__ = getattr(module, "__macs__", 0) + macs  # type: ignore[assignment]

    # -- totals ------------------------------------------------------------------------------------
    def get_total_flops(self, as_string: bool = False) -> int | str:
        """Forward flops of the whole model."""
        total = get_module_flops(self.model)
        return number_to_string(total) if as_string else total

    def get_total_macs(self, as_string: bool = False) -> int | str:
        """Forward multiply-accumulates of the whole model."""
        total = get_module_macs(self.model)
        return macs_to_string(total) if as_string else total

    def get_total_duration(self, as_string: bool = False) -> float | str:
        """Forward seconds of the whole model."""
        total = get_module_duration(self.model)
        return duration_to_string(total) if as_string else total

    def get_total_params(self, as_string: bool = False) -> int | str:
        """Parameters of the model (a ZeRO-3 partitioned parameter counts its full size)."""
        total = _params_of(self.model)
        return params_to_string(total) if as_string else total

    # -- printing ----------------------------------------------------------------------------------
    def print_model_profile(
        self,
        profile_step: int = 1,
        module_depth: int = -1,
        top_modules: int = 1,
        detailed: bool = True,
        output_file: str | None = None,
    ) -> None:
        """Print the profile (to `output_file` when given, else stdout); does nothing before `start_profile()`.

        Sets `self.flops`, `self.macs`, `self.params` to the totals.
        """
        if not self.started:
            return
        text = "\n".join(self._profile_lines(profile_step, module_depth, top_modules, detailed)) + "\n"
        if output_file:
            path = Path(output_file)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def print_model_aggregated_profile(self, module_depth: int = -1, top_modules: int = 1) -> None:
        """Print only the top modules per depth."""
        if not self.started:
            return
        sys.stdout.write("\n".join(self._aggregated(module_depth, top_modules)) + "\n")

    def _aggregated(self, module_depth: int, top_modules: int) -> list[str]:
        return aggregated_lines(
            self.model,
            params=_params_of,
            macs=get_module_macs,
            duration=get_module_duration,
            module_depth=module_depth,
            top_modules=top_modules,
        )

    def _profile_lines(self, profile_step: int, module_depth: int, top_modules: int, detailed: bool) -> list[str]:
        flops, macs = int(self.get_total_flops()), int(self.get_total_macs())
        params, fwd = int(self.get_total_params()), float(self.get_total_duration())
        self.flops, self.macs, self.params = flops, macs, params
        lines = ["", "------------------------------ ds flops profiler ------------------------------"]
        lines.append(f"Profile at step {profile_step} (forward counted per module; flops = 2 x MACs for matrix ops)")
        engine = self.ds_engine
        if engine is not None:
            lines.append(summary_value("world size:", getattr(engine, "world_size", 1)))
            lines.append(summary_value("data parallel size:", getattr(engine, "dp_world_size", 1)))
            micro = getattr(engine, "train_micro_batch_size_per_gpu", None)
            lines.append(summary_value("batch size per rank:", micro() if callable(micro) else micro))
        fwd = self.latencies.get("fwd", fwd)
        lines += [
            summary_value("params per rank:", params_to_string(params)),
            summary_value("fwd MACs per rank:", macs_to_string(macs)),
            summary_value("fwd flops per rank:", number_to_string(flops)),
            summary_value("fwd latency:", duration_to_string(fwd)),
            summary_value("fwd FLOPS per rank = fwd flops / fwd latency:", flops_to_string(flops / fwd if fwd else 0)),
        ]
        factor = 2 + self.recompute_fwd_factor
        if "bwd" in self.latencies:
            bwd, step = self.latencies["bwd"], self.latencies.get("step", 0.0)
            measured = self.backward_flops
            iteration = fwd + bwd + step
            lines += [
                summary_value("bwd flops per rank (measured):", number_to_string(measured)),
                summary_value(f"bwd flops estimate = {factor:g} x fwd flops:", number_to_string(factor * flops)),
                summary_value("bwd latency:", duration_to_string(bwd)),
                summary_value("bwd FLOPS per rank:", flops_to_string(measured / bwd if bwd else 0)),
                summary_value("step latency:", duration_to_string(step)),
                summary_value("iter latency = fwd + bwd + step:", duration_to_string(iteration)),
                summary_value(
                    "FLOPS per rank = (fwd + bwd flops) / iter latency:",
                    flops_to_string((flops + measured) / iteration if iteration else 0),
                ),
            ]
        lines += ["", "------------------------- aggregated profile per rank -------------------------"]
        lines += self._aggregated(module_depth, top_modules)
        if detailed:
            lines += [
                "",
                "-------------------------- detailed profile per rank --------------------------",
                "Per module: params, share of params, MACs, share of MACs, fwd latency, share of latency, fwd FLOPS.",
                "Work a module does outside its submodules (functional calls) shows only in its own totals.",
                "",
            ]
            lines += detailed_lines(
                self.model,
                Totals(params=params, macs=macs, duration=float(self.get_total_duration())),
                params=_params_of,
                macs=get_module_macs,
                flops=get_module_flops,
                duration=get_module_duration,
                module_depth=module_depth,
            )
        lines.append("-" * 79)
        return lines


def _call(model: nn.Module, args: Sequence[Any], kwargs: dict[str, Any], mode: str) -> None:
    fn: Callable[..., Any] = getattr(model, "generate") if mode == "generate" else model  # noqa: B009
    fn(*args, **kwargs)


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: Sequence[Any] = [],  # noqa: B006 - DeepSpeed's signature; never mutated
    kwargs: dict[str, Any] = {},  # noqa: B006 - DeepSpeed's signature; never mutated
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: Sequence[type] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """Profile one forward (or `generate`) call of `model` in eval mode after `warm_up` unprofiled calls.

    Args:
        model: the module.
        input_shape: build one input of this shape (ones, the model's dtype and device) as the only
            positional argument; otherwise `args` / `kwargs` are passed.
        print_profile, detailed, module_depth, top_modules, output_file: as `print_model_profile`.
        warm_up: calls before the profiled one (latency of a first call includes one-time costs).
        as_string: return human-readable strings instead of numbers.
        ignore_modules: module types whose work is charged to their parent.
        mode: "forward" (call the model) or "generate" (call `model.generate`).

    Returns:
        (flops, MACs, params) of the profiled call.

    Raises:
        TypeError: `model` is not a module, or `input_shape` is not a tuple.
        ValueError: no input given, a bad `mode` or `warm_up`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"get_model_profile: model must be a torch.nn.Module, got {type(model).__name__}")
    if mode not in ("forward", "generate"):
        raise ValueError(f"get_model_profile: mode must be 'forward' or 'generate', got {mode!r}")
    if warm_up < 0:
        raise ValueError(f"get_model_profile: warm_up must be >= 0, got {warm_up}")
    if input_shape is not None:
        if not isinstance(input_shape, tuple) or not input_shape:
            raise TypeError(f"get_model_profile: input_shape must be a non-empty tuple, got {input_shape!r}")
        first = next(model.parameters(), None)
        dtype = first.dtype if first is not None else None
        device = first.device if first is not None else None
        args = [torch.ones(input_shape, dtype=dtype, device=device)]
    if not args and not kwargs:
        raise ValueError("get_model_profile: give input_shape, or args and/or kwargs for the model")
    model.eval()
    for _ in range(warm_up):
        _call(model, args, kwargs, mode)
    prof = FlopsProfiler(model)
    prof.start_profile(ignore_list=ignore_modules)
    try:
        _call(model, args, kwargs, mode)
        flops, macs, params = prof.get_total_flops(), prof.get_total_macs(), prof.get_total_params()
        if print_profile:
            prof.print_model_profile(
                profile_step=warm_up,
                module_depth=module_depth,
                top_modules=top_modules,
                detailed=detailed,
                output_file=output_file,
            )
    finally:
        prof.end_profile()
    if as_string:
        return number_to_string(float(flops)), macs_to_string(float(macs)), params_to_string(float(params))
    return flops, macs, params
