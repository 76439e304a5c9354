"""`compile`: DeepCompile's settings, with DeepSpeed 0.19.8's keys and defaults.

`deepcompile: true` makes `engine.compile()` capture the forward with torch.compile and, at ZeRO stage 3,
rewrite the graph: each partitioned parameter is all-gathered right before its first use and released
after its last, in the forward graph and (re-gathered) in the backward graph, the gathers bucketed and
started one bucket ahead so they overlap computation (ds-zero's `_compile`); after DeepSpeed's 5 warm-up
steps the parameters that fit in the memory the warm-up left unused are kept whole and the graphs
compiled again without their gathers (selective unsharding, on as in DeepSpeed's default schedule). At
stages 1 and 2 the forward and backward are compiled and gradient reduction stays with ZeRO's eager
per-parameter hooks. `debug_log` logs the placed schedule at INFO. It runs wherever torch.compile does,
CPU included.

Knobs that only tune DeepSpeed's CUDA implementation (activation freeing, double buffering, the
`sync_*` fences, input storage) have no effect here and warn when set (`ignored_keys`); the offload modes,
symmetric memory and the AutoSP/AutoTP passes are refused by name (`inert_keys`, `passes`).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import AfterValidator

from ds_comm import ConfigModel

__all__ = ["CompileConfig"]

_NOT_IN_DS = "is not implemented in ds's DeepCompile"
_NO_EFFECT = "it tunes DeepSpeed's CUDA DeepCompile; ds's passes do not read it"


def _passes(value: list[str] | None) -> list[str] | None:
    if value is None:
        return value
    refused = [name for name in value if name in ("autosp", "autotp")]
    if refused:
        raise ValueError(
            f"the {refused[0]!r} pass {_NOT_IN_DS}; use 'z1' or 'z3' (or leave passes unset to follow the ZeRO stage)"
        )
    return value


class CompileConfig(ConfigModel):
    """`compile`: DeepCompile's settings (DeepSpeed's `CompileConfig`)."""

    inert_keys: ClassVar[dict[str, str]] = {
        "autoep_non_moe": f"compiling only the parts around AutoEP layers {_NOT_IN_DS}",
        "offload_activation": f"activation offload {_NOT_IN_DS}",
        "offload_opt_states": f"optimizer-state offload {_NOT_IN_DS}; use zero_optimization.offload_optimizer",
        "offload_parameters": f"parameter offload {_NOT_IN_DS}; use zero_optimization.offload_param",
        "symmetric_memory": f"symmetric memory (a CUDA feature) {_NOT_IN_DS}",
    }
    ignored_keys: ClassVar[dict[str, str]] = {
        name: _NO_EFFECT
        for name in (
            "free_activation",
            "free_activation_threshold",
            "offload_activation_pin_memory",
            "double_buffer",
            "sync_before_reduce",
            "sync_after_reduce",
            "sync_before_allgather",
            "sync_after_allgather",
            "keep_int_input_tensors",
            "keep_all_input_tensors",
        )
    }

    deepcompile: bool = False
    """Compile the step with ZeRO's collectives scheduled in the graph (takes effect at `engine.compile()`)."""
    autoep_non_moe: bool = False
    """Compile the parents of AutoEP layers only; only false is accepted."""
    free_activation: bool = False
    free_activation_threshold: int = 10485760
    offload_activation: bool = False
    offload_activation_pin_memory: bool = True
    offload_opt_states: bool = False
    double_buffer: bool = True
    symmetric_memory: bool = False
    debug_log: bool = False
    """Log every compiled graph's gathers and releases at INFO (DEBUG otherwise)."""
    offload_parameters: bool = False
    sync_before_reduce: bool = False
    sync_after_reduce: bool = False
    sync_before_allgather: bool = False
    sync_after_allgather: bool = False
    keep_int_input_tensors: bool = True
    keep_all_input_tensors: bool = False
    passes: Annotated[list[Literal["z1", "z3", "autosp", "autotp"]] | None, AfterValidator(_passes)] = None
    """Which ZeRO pass to run ('z1' covers stages 1 and 2, 'z3' stage 3); unset: the configured stage's."""


def describe_deepcompile(settings: CompileConfig, stage: int) -> list[str]:
    """What `engine.compile()` will do under these settings at ZeRO `stage` (for `explain`); [] when off."""
    if not settings.deepcompile:
        return []
    if stage == 3:
        lines = [
            "engine.compile() captures the forward as one graph (backend inductor, or eager/aot_eager)",
            "pass z3: each partitioned parameter is all-gathered right before its first use and released after",
            "  its last, in the forward graph and again in the backward graph (re-gathered, not saved)",
            "prefetch: adjacent gathers (a layer's weight and bias) are one collective, started asynchronously",
            "  one bucket ahead and waited for just before the first use",
            "gradients: whole on each parameter, reduce-scattered by stage 3's reducer (eager hooks)",
            "selective unsharding: after 5 warm-up steps, the smallest partitioned parameters that fit in",
            "  90% of memory less the warm-up's peak (a CPU host shared by its ranks) stay whole, and the",
            "  module is compiled again without their gathers (all of them when the model fits)",
            "a graph break: warning naming the place, then eager ZeRO-3 hooks for the rest of the run",
        ]
    else:
        lines = [
            "engine.compile() compiles the forward and backward with the chosen backend",
            f"pass z1: gradient reduction stays with ZeRO stage {stage}'s eager hooks (nothing is gathered)",
        ]
    log = "INFO" if settings.debug_log else "DEBUG (compile.debug_log: INFO)"
    lines.append(f"the placed schedule is logged at {log} and returned by engine.deepcompile_schedule")
    return lines
