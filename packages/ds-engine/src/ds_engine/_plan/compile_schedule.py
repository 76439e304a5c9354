"""What a DeepCompile pass schedule (`engine.compile(schedule=...)`) means in ds, step by step.

DeepSpeed 0.19.8 takes `[(global_step, [pass, ...]), ...]` and, at each listed step, compiles the graphs
again from the captured original with exactly the listed passes (pass names, or the pass callables of
`deepspeed.compile.passes.*`, see `pass_contracts`). ds reads the same schedule, checks it against
DeepSpeed's pass contracts, and turns each step into ds-zero's DeepCompile settings:

- ZeRO-3: `zero3_compile` puts each partitioned parameter's gather and release in the forward and
  backward graphs; `prefetch` makes the gathers bucketed asynchronous collectives started one bucket
  ahead of their use (without it each gather is a blocking collective in place); `selective_gather`
  runs selective unsharding when its step begins (the partitioned parameters that fit in the memory not
  used so far are kept whole and leave the graphs). Parameters kept whole stay whole at later steps.
- ZeRO-1/2: `zero1_compile` / `zero2_compile` place each parameter's gradient hand-over to ZeRO's reducer
  right after its producing node in the backward graph (`ds_zero._compile.reduce_backend`; the reducer
  decides by stage: stage 2 reduces during the backward, stage 1 at the accumulation boundary, so either
  name at either stage means the same compile in ds, as one compile serves every step).

Refused before anything is compiled, naming the step and the pass:
- a ZeRO-3 step without `zero3_compile` (the graph would read the parameters' partitions as if whole;
  DeepSpeed would run it and train wrong), a ZeRO-1/2 step without `zero1_compile`/`zero2_compile`, and a
  schedule that does not begin at step 0 (the steps before it would have no passes);
- a pass for another ZeRO stage (`zero3_compile` at stage 2, `zero1_compile` at stage 3), naming
  `zero_optimization.stage`; any pass at stage 0, which DeepCompile does not run at;
- DeepCompile's offload passes, naming the ds config key that does the job (`zero_optimization.offload_param`,
  `zero_optimization.offload_optimizer`, `activation_checkpointing.cpu_checkpointing`);
- a pass registered by the user (`engine.register_compile_pass`), or a built-in name re-registered with
  another function: DeepSpeed calls those as `fn(gm, graph_id, graph_order, profiling_results,
  create_inputs_fn, mem_budget, param_manager, bwd)` over its own profiler and `DSGraphParamManager`, which
  ds does not have, so ds cannot run them; their contracts still take part in the validation;
- steps out of order (DeepSpeed would never reach a step listed after a later one).

Without a schedule ds keeps its default: `prefetch` from step 0 and selective unsharding after
DeepSpeed's 5 warm-up steps (`default_schedule`), which is DeepSpeed's default schedule with the
asynchronous gathers on from the start.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from ds_engine._plan.pass_contracts import BUILTIN_PASSES, registered_passes, resolve_pass_name, validate_schedule

__all__ = [
    "DEEPSPEED_WARMUP_STEPS",
    "OFFLOAD_PASS_KEYS",
    "CompileStep",
    "default_schedule",
    "describe_steps",
    "plan_schedule",
]

ZERO3 = "zero3_compile"
PREFETCH = "prefetch"
SELECTIVE = "selective_gather"
ZERO12 = ("zero1_compile", "zero2_compile")
#: steps run before selective unsharding in DeepSpeed's default schedule (its WARMUP; ds-zero's WARMUP_STEPS)
DEEPSPEED_WARMUP_STEPS = 5

#: DeepCompile's offload passes -> the ds config key that offloads the same state
OFFLOAD_PASS_KEYS: dict[str, str] = {
    "offload_parameters": "zero_optimization.offload_param",
    "offload_adam_states": "zero_optimization.offload_optimizer",
    "offload_adam_states_sync": "zero_optimization.offload_optimizer",
    "offload_adam_states_for_init": "zero_optimization.offload_optimizer",
    "offload_activation": "activation_checkpointing.cpu_checkpointing",
    "offload_activation_floor": "activation_checkpointing.cpu_checkpointing",
}

_USER_PASS = (
    "DeepSpeed runs such a pass as fn(gm, graph_id, graph_order, profiling_results, create_inputs_fn, "
    "mem_budget, param_manager, bwd) over its own graph profiler and DSGraphParamManager, which ds's DeepCompile "
    "does not have, so ds cannot run it"
)


@dataclasses.dataclass(frozen=True)
class CompileStep:
    """The passes in force from optimizer step `step` until the next listed step.

    Attributes:
        step: the global step (optimizer steps taken) at whose first training forward the passes apply.
        passes: the pass names, in the schedule's order.
        prefetch: ZeRO-3 gathers are bucketed asynchronous collectives started ahead of use (else blocking).
        unshard: selective unsharding runs when this step begins.
    """

    step: int
    passes: tuple[str, ...]
    prefetch: bool = False
    unshard: bool = False

    def line(self) -> str:
        return f"step {self.step}: {', '.join(self.passes)}"


def default_schedule(stage: int, warmup_steps: int = DEEPSPEED_WARMUP_STEPS) -> tuple[CompileStep, ...]:
    """ds's schedule at ZeRO `stage` when `engine.compile()` gets none. Stage 3: `prefetch` from the start,
    selective unsharding after `warmup_steps` (DeepSpeed's default turns its prefetch on at that step too);
    stages 1/2: the stage's pass."""
    if stage != 3:
        return (CompileStep(0, (f"zero{stage}_compile",)),)
    return (
        CompileStep(0, (ZERO3, PREFETCH), prefetch=True),
        CompileStep(warmup_steps, (ZERO3, PREFETCH, SELECTIVE), prefetch=True, unshard=True),
    )


def _entries(schedule: object) -> list[tuple[int, list[object]]]:
    """`schedule`'s steps, checked for shape and order."""
    if not isinstance(schedule, (list, tuple)):
        raise TypeError(
            "engine.compile(schedule=...): expected a list of (global_step, [pass, ...]), got "
            f"{type(schedule).__name__}"
        )
    if not schedule:
        raise ValueError("engine.compile(schedule=[]): the schedule needs a step 0 (the passes to compile with)")
    out: list[tuple[int, list[object]]] = []
    for entry in schedule:
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2):
            raise TypeError(f"engine.compile(schedule=...): each entry is (global_step, [pass, ...]), got {entry!r}")
        step, passes = entry
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise TypeError(f"engine.compile(schedule=...): the step of {entry!r} must be an int >= 0")
        if not isinstance(passes, (list, tuple)):
            raise TypeError(f"engine.compile(schedule=...): the passes of step {step} must be a list, got {passes!r}")
        if out and step <= out[-1][0]:
            raise ValueError(
                f"engine.compile(schedule=...): step {step} is listed after step {out[-1][0]}; list the steps in "
                "increasing order, each once"
            )
        out.append((step, list(passes)))
    if out[0][0] != 0:
        raise ValueError(
            f"engine.compile(schedule=...): the first step is {out[0][0]}; the schedule must begin at step 0 (the "
            "steps before the first listed one would have no passes)"
        )
    return out


def _names(step: int, passes: list[object], registry: dict[str, Callable[..., Any]]) -> tuple[str, ...]:
    names = []
    for ref in passes:
        name = resolve_pass_name(ref, registry)
        if name is None:
            raise ValueError(
                f"engine.compile(schedule=...): step {step} lists {ref!r}, which is no registered pass; use a pass "
                f"name ({', '.join(sorted(registry))}) or register it with engine.register_compile_pass"
            )
        if name not in registry:
            raise ValueError(
                f"engine.compile(schedule=...): step {step} lists the unknown pass {name!r}; the passes are "
                f"{', '.join(sorted(registry))}"
            )
        names.append(name)
    return tuple(names)


def _refuse(step: int, name: str, stage: int, registry: dict[str, Callable[..., Any]]) -> None:
    where = f"engine.compile(schedule=...): pass {name!r} (step {step})"
    builtin = BUILTIN_PASSES.get(name)
    if builtin is None or registry[name] is not builtin:
        raise ValueError(f"{where} is a user-registered pass: {_USER_PASS}; remove it from the schedule")
    if name in OFFLOAD_PASS_KEYS:
        raise ValueError(
            f"{where}: DeepCompile's offload passes are not implemented in ds; use the config key "
            f"{OFFLOAD_PASS_KEYS[name]} instead and leave {name!r} out of the schedule"
        )
    if stage == 0:
        raise ValueError(f"{where}: DeepCompile's passes apply at zero_optimization.stage 1, 2 or 3, not 0")
    if stage == 3 and name in ZERO12:
        raise ValueError(
            f"{where} applies at zero_optimization.stage 1 or 2, not 3; at stage 3 use {ZERO3!r} (with "
            f"{PREFETCH!r} and {SELECTIVE!r} if wanted)"
        )
    if stage != 3 and name in (ZERO3, PREFETCH, SELECTIVE):
        raise ValueError(
            f"{where} applies at zero_optimization.stage 3, not {stage}; at stage {stage} use 'zero{stage}_compile'"
        )


def plan_schedule(schedule: object, *, stage: int) -> tuple[CompileStep, ...]:
    """Check `schedule` (DeepSpeed's `[(global_step, [pass, ...])]`) and turn it into ds's steps at ZeRO `stage`.

    Raises:
        TypeError: the schedule is not a list of (int, list) pairs.
        PassContractError: a step breaks a pass contract (a ValueError naming the step and the pass).
        ValueError: an unknown or unregistered pass, steps out of order or not beginning at 0, or a pass ds
            refuses (see the module docstring), naming the step and the pass.
    """
    entries = _entries(schedule)
    registry = registered_passes()
    named = [(step, _names(step, passes, registry)) for step, passes in entries]
    validate_schedule(named, registry)
    steps = []
    for step, names in named:
        for name in names:
            _refuse(step, name, stage, registry)
        needed = (ZERO3,) if stage == 3 else ZERO12
        if not any(name in needed for name in names):
            why = (
                "the graph would read the partitioned parameters as if they were whole"
                if stage == 3
                else "every step names the stage's ZeRO pass"
            )
            raise ValueError(
                f"engine.compile(schedule=...): step {step} ({list(names)}) has no {' or '.join(map(repr, needed))} "
                f"at zero_optimization.stage={stage} ({why}); add it to step {step}"
            )
        steps.append(CompileStep(step, names, prefetch=PREFETCH in names, unshard=SELECTIVE in names))
    return tuple(steps)


def describe_steps(steps: Sequence[CompileStep]) -> str:
    """`steps` as one line: `step 0: zero3_compile; step 5: zero3_compile, prefetch, selective_gather`."""
    return "; ".join(step.line() for step in steps)
