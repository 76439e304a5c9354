"""DeepCompile pass names, their contracts, and the check that a pass schedule keeps them.

DeepSpeed 0.19.8 describes a DeepCompile pass schedule as `[(global_step, [pass, ...]), ...]`: at each
listed step the graphs are compiled again from the captured original with exactly the listed passes,
left to right. Each pass may carry a `PassContract`: the capabilities it `provides` to the passes after it,
those it `requires` from an earlier pass *of the same step* (nothing carries over between steps, since
every step starts from the original graph), and the passes it `conflicts_with` (either side may declare a
conflict, and a conflict may name a pass that has no contract of its own). A pass without a contract is
unconstrained. ds keeps DeepSpeed's names, contracts and rules, so a schedule valid (or invalid) for
DeepSpeed is valid (or invalid) for ds; what each pass means in ds is `_plan.compile_schedule`'s business.

The registries are process-wide, as DeepSpeed's are (`deepspeed.compile.passes.contract._pass_contracts`
is the very dict below): `_pass_contracts` (name -> contract) and `_pass_functions` (name -> the callable a
schedule may use instead of the name). The built-in passes are registered when this module is imported;
`register_compile_pass` adds or replaces one (a `None` contract clears the previous one, as in DeepSpeed).

[Note: the built-in pass callables]
DeepSpeed's passes are functions over its own graph internals (`fn(gm, graph_id, graph_order,
profiling_results, create_inputs_fn, mem_budget, param_manager, bwd)`). ds places its collectives with
ds-zero's passes instead, chosen by the engine per step, so `add_z3_gather_release` and its siblings are
`BuiltinPass` objects: a schedule may hold them (they resolve to their names by identity, as in
DeepSpeed), and calling one directly raises a `TypeError` that says so.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "BUILTIN_PASSES",
    "CAP_OPT_STATES_EVICTED",
    "CAP_Z3_GATHER_RELEASE",
    "BuiltinPass",
    "PassContract",
    "PassContractError",
    "get_pass_contract",
    "register_compile_pass",
    "register_pass_contract",
    "registered_passes",
    "resolve_pass_name",
    "validate_schedule",
]

#: the capability the ZeRO-3 pass gives the passes that rearrange its gathers (DeepSpeed's tag)
CAP_Z3_GATHER_RELEASE = "z3_gather_release"
#: optimizer state is already off the accelerator when the following passes plan (DeepSpeed's tag)
CAP_OPT_STATES_EVICTED = "opt_states_evicted"


@dataclasses.dataclass(frozen=True)
class PassContract:
    """What a pass needs from the passes before it in its step, what it gives them, what it cannot share a step with.

    Attributes:
        provides: capability tags the passes after this one (same step) may require.
        requires: capability tags an earlier pass of the same step must provide.
        conflicts_with: names of passes that may not be in the same step (checked in both directions).
        phase: which graphs the pass rewrites ("forward", "backward" or "both"); informational.
    """

    provides: frozenset[str] = frozenset()
    requires: frozenset[str] = frozenset()
    conflicts_with: frozenset[str] = frozenset()
    phase: str = "both"


class PassContractError(ValueError):
    """A pass schedule breaks a registered contract; the message names the step, the pass and the rule."""


_UNCONSTRAINED = PassContract()

#: name -> contract; the dict DeepSpeed's `contract._pass_contracts` is
_pass_contracts: dict[str, PassContract] = {}
#: name -> the callable a schedule may list in place of the name (DeepSpeed's `backend.opt_passes`)
_pass_functions: dict[str, Callable[..., Any]] = {}


def register_pass_contract(name: str, contract: PassContract | None) -> None:
    """Set the contract of pass `name`; `None` removes it (the pass is unconstrained again)."""
    if contract is None:
        _pass_contracts.pop(name, None)
    else:
        _pass_contracts[name] = contract


def get_pass_contract(name: str) -> PassContract | None:
    """The contract registered for pass `name`, or None."""
    return _pass_contracts.get(name)


def register_compile_pass(name: str, fn: Callable[..., Any], contract: PassContract | None = None) -> None:
    """Register `fn` as pass `name` (a schedule may list either) with `contract` (None clears the old one).

    Raises:
        TypeError: `name` is not a string or `fn` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"register_compile_pass(name={name!r}): the pass name must be a non-empty string")
    if not callable(fn):
        raise TypeError(f"register_compile_pass({name!r}, fn={fn!r}): fn must be callable")
    _pass_functions[name] = fn
    register_pass_contract(name, contract)


def registered_passes() -> dict[str, Callable[..., Any]]:
    """A copy of the name -> callable registry (the `name_registry` `validate_schedule` resolves with)."""
    return dict(_pass_functions)


def resolve_pass_name(pass_ref: object, name_registry: Mapping[str, object] | None) -> str | None:
    """The name `pass_ref` stands for: itself when a string, else the one name it is registered under
    (by identity; callables need not be hashable); None when it is registered under none.

    Raises:
        PassContractError: the callable is registered under several names (list it by name).
    """
    if isinstance(pass_ref, str):
        return pass_ref
    if name_registry is None:
        return None
    names = sorted(name for name, fn in name_registry.items() if fn is pass_ref)
    if len(names) > 1:
        raise PassContractError(
            f"the pass callable {pass_ref!r} is registered under multiple names {names}; list it by name in the "
            "schedule so that one contract applies"
        )
    return names[0] if names else None


def validate_schedule(
    schedule: Sequence[tuple[int, Sequence[object]]], name_registry: Mapping[str, object] | None = None
) -> None:
    """Check every step of `schedule` against the registered contracts, each step on its own.

    Within a step the passes run left to right: a pass's `requires` must be among the `provides` of the
    passes before it in that step, and no two passes of the step may conflict (either may declare it).
    A pass that resolves to no name, or has no contract, requires and provides nothing.

    Args:
        schedule: `[(global_step, [pass name or callable, ...]), ...]`.
        name_registry: name -> callable, to resolve callables listed in the schedule (by identity).

    Raises:
        PassContractError: the first unmet requirement or conflict, naming the step and the pass.
    """
    for step, passes in schedule:
        provided: set[str] = set()
        applied: list[str] = []
        for pass_ref in passes:
            name = resolve_pass_name(pass_ref, name_registry)
            if name is None:
                continue
            contract = _pass_contracts.get(name, _UNCONSTRAINED)
            missing = contract.requires - provided
            if missing:
                raise PassContractError(
                    f"pass {name!r} (step {step}) requires {sorted(missing)}, which no earlier pass of step {step} "
                    f"provides (passes before it: {applied}); every step starts from the original graph, so list "
                    "the providing pass before it in the same step"
                )
            clashing = set(contract.conflicts_with.intersection(applied))
            clashing.update(p for p in applied if name in _pass_contracts.get(p, _UNCONSTRAINED).conflicts_with)
            if clashing:
                raise PassContractError(
                    f"pass {name!r} (step {step}) conflicts with {sorted(clashing)} in the same step; keep one of them"
                )
            provided |= contract.provides
            applied.append(name)


@dataclasses.dataclass(frozen=True, eq=False)
class BuiltinPass:
    """One of DeepSpeed's built-in passes as a schedule entry (`schedule=[(0, [add_z3_gather_release])]`).

    ds applies the built-in passes itself (the engine turns each step's names into ds-zero's DeepCompile
    settings), so this object is a name a schedule can hold, not a graph function.
    """

    name: str
    contract: PassContract
    deepspeed_function: str  # DeepSpeed's module-qualified name of the function this stands for

    def __call__(self, *args: object, **kwargs: object) -> Any:
        raise TypeError(
            f"{self.deepspeed_function} is a DeepCompile pass that ds applies itself: list it (or {self.name!r}) in "
            "engine.compile(schedule=[(step, [...])]); ds does not run DeepSpeed's graph passes on their own"
        )

    def __repr__(self) -> str:
        return f"<DeepCompile pass {self.name!r} ({self.deepspeed_function})>"


_ZERO3 = "zero3_compile"
_ZERO1 = "zero1_compile"
_ZERO2 = "zero2_compile"
_OFFLOAD_ADAM = "offload_adam_states"
#: one offload target per run, and the optimizer-state passes act on ZeRO-3's optimizer only (DeepSpeed's rule)
_OFFLOAD_ADAM_CONFLICTS = frozenset({"offload_parameters", _ZERO1, _ZERO2})


def _builtin(name: str, function: str, contract: PassContract) -> BuiltinPass:
    return BuiltinPass(name, contract, f"deepspeed.compile.passes.{function}")


#: DeepSpeed 0.19.8's built-in passes, by name, with DeepSpeed's contracts
BUILTIN_PASSES: dict[str, BuiltinPass] = {
    p.name: p
    for p in (
        _builtin(_ZERO1, "zero_1_and_2_compile.add_z1_reduce", PassContract(conflicts_with=frozenset({_ZERO3}))),
        _builtin(
            _ZERO2, "zero_1_and_2_compile.add_z2_reduce", PassContract(conflicts_with=frozenset({_ZERO3, _ZERO1}))
        ),
        _builtin(
            _ZERO3, "zero3_compile.add_z3_gather_release", PassContract(provides=frozenset({CAP_Z3_GATHER_RELEASE}))
        ),
        _builtin("prefetch", "prefetch.schedule_prefetch", PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE}))),
        _builtin(
            "selective_gather",
            "selective_gather.selective_gather",
            PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE})),
        ),
        _builtin(
            "offload_parameters",
            "offload_parameters.offload_parameter_fwd",
            PassContract(requires=frozenset({CAP_Z3_GATHER_RELEASE})),
        ),
        _builtin(
            _OFFLOAD_ADAM,
            "offload_adam_states.move_opt_states",
            PassContract(requires=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_OFFLOAD_ADAM_CONFLICTS),
        ),
        _builtin(
            "offload_adam_states_sync",
            "offload_adam_states.move_opt_states_sync",
            PassContract(conflicts_with=_OFFLOAD_ADAM_CONFLICTS | {_OFFLOAD_ADAM}),
        ),
        _builtin(
            "offload_adam_states_for_init",
            "offload_adam_states.offload_adam_states_for_init",
            PassContract(provides=frozenset({CAP_OPT_STATES_EVICTED}), conflicts_with=_OFFLOAD_ADAM_CONFLICTS),
        ),
        _builtin("offload_activation_floor", "offload_activation.offload_activation_floor", PassContract()),
        _builtin("offload_activation", "offload_activation.offload_activation", PassContract()),
    )
}

for _pass in BUILTIN_PASSES.values():
    register_compile_pass(_pass.name, _pass, _pass.contract)
