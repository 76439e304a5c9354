"""DeepCompile pass schedules (`engine.compile(schedule=...)`): DeepSpeed's pass names and contracts, ds's rules.

Single process: the contract checks (`validate_schedule`, with DeepSpeed's built-in contracts), the
DeepSpeed module paths under `ds_engine.compile.passes`, how a schedule turns into ds's steps
(`plan_schedule`), and what `engine.compile()` refuses before compiling anything (a ZeRO-3 step without
`zero3_compile`, a pass for another stage, the offload passes, user-registered passes), the warning
without `compile.deepcompile`, and a ZeRO-1 schedule training as eager. The scheduled ZeRO-3 recompiles
run on 2 ranks in `dist/test_dist_deepcompile.py`.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_engine._plan import pass_contracts
from ds_engine._plan.compile_schedule import DEEPSPEED_WARMUP_STEPS, CompileStep, default_schedule, plan_schedule
from ds_engine._plan.pass_contracts import PassContract, PassContractError, validate_schedule
from ds_engine.compile.passes import (
    contract,
    offload_activation,
    offload_adam_states,
    offload_parameters,
    prefetch,
    selective_gather,
    zero3_compile,
    zero_1_and_2_compile,
)

needs_zero = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero")


@pytest.fixture
def registry() -> Iterator[None]:
    """Leave the process-wide registries as they were (the tests register passes)."""
    contracts, functions = dict(pass_contracts._pass_contracts), dict(pass_contracts._pass_functions)
    yield
    pass_contracts._pass_contracts.clear()
    pass_contracts._pass_contracts.update(contracts)
    pass_contracts._pass_functions.clear()
    pass_contracts._pass_functions.update(functions)


def test_deepspeed_paths_expose_the_pass_names_contracts_and_callables() -> None:
    assert contract._pass_contracts is pass_contracts._pass_contracts  # one registry under both names
    assert (zero3_compile.NAME, prefetch.NAME, selective_gather.NAME) == (
        "zero3_compile",
        "prefetch",
        "selective_gather",
    )
    assert (zero_1_and_2_compile.NAME_Z1, zero_1_and_2_compile.NAME_Z2) == ("zero1_compile", "zero2_compile")
    assert offload_adam_states.NAME_FOR_INIT == "offload_adam_states_for_init"
    assert offload_activation.FLOOR_NAME == "offload_activation_floor"
    # DeepSpeed's contracts, fact by fact
    assert zero3_compile.CONTRACT.provides == {contract.CAP_Z3_GATHER_RELEASE}
    assert prefetch.CONTRACT.requires == selective_gather.CONTRACT.requires == {"z3_gather_release"}
    assert offload_parameters.CONTRACT.requires == {"z3_gather_release"}
    assert zero_1_and_2_compile.CONTRACT_Z1.conflicts_with == {"zero3_compile"}
    assert zero_1_and_2_compile.CONTRACT_Z2.conflicts_with == {"zero3_compile", "zero1_compile"}
    assert offload_adam_states.CONTRACT.requires == {"opt_states_evicted"}
    assert offload_adam_states.CONTRACT_SYNC.conflicts_with == {
        "offload_parameters",
        "zero1_compile",
        "zero2_compile",
        "offload_adam_states",
    }
    assert offload_adam_states.CONTRACT_FOR_INIT.provides == {"opt_states_evicted"}
    assert offload_activation.CONTRACT == PassContract()
    for name in ("zero3_compile", "prefetch", "offload_adam_states_sync", "offload_activation_floor"):
        assert contract.get_pass_contract(name) is pass_contracts.BUILTIN_PASSES[name].contract


def test_a_builtin_pass_callable_says_ds_applies_it() -> None:
    with pytest.raises(TypeError, match=r"zero3_compile.add_z3_gather_release is a DeepCompile pass that ds applies"):
        zero3_compile.add_z3_gather_release(None, 0, [], {}, None, 0.0, None, False)


def test_validation_checks_requirements_per_step_and_conflicts_both_ways() -> None:
    registry = pass_contracts.registered_passes()
    validate_schedule([(0, ["zero3_compile"]), (5, ["zero3_compile", "prefetch", "selective_gather"])], registry)
    with pytest.raises(PassContractError, match=r"pass 'prefetch' \(step 2\) requires \['z3_gather_release'\]"):
        validate_schedule([(0, ["zero3_compile"]), (2, ["prefetch", "zero3_compile"])], registry)
    with pytest.raises(PassContractError, match=r"pass 'zero3_compile' \(step 0\) conflicts with \['zero1_compile'\]"):
        validate_schedule([(0, [zero_1_and_2_compile.add_z1_reduce, zero3_compile.add_z3_gather_release])], registry)


def test_register_pass_contract_none_clears(registry: None) -> None:
    contract.register_pass_contract("mine", PassContract(requires=frozenset({"x"})))
    with pytest.raises(PassContractError, match="requires"):
        validate_schedule([(0, ["mine"])])
    contract.register_pass_contract("mine", None)
    validate_schedule([(0, ["mine"])])


def test_plan_turns_names_and_callables_into_steps() -> None:
    steps = plan_schedule(
        [
            (0, [zero3_compile.add_z3_gather_release]),
            (2, ["zero3_compile", "prefetch"]),
            (4, ["zero3_compile", "prefetch", "selective_gather"]),
        ],
        stage=3,
    )
    assert steps == (
        CompileStep(0, ("zero3_compile",)),
        CompileStep(2, ("zero3_compile", "prefetch"), prefetch=True),
        CompileStep(4, ("zero3_compile", "prefetch", "selective_gather"), prefetch=True, unshard=True),
    )
    assert plan_schedule([(0, [zero_1_and_2_compile.add_z2_reduce])], stage=2) == (CompileStep(0, ("zero2_compile",)),)
    assert plan_schedule([(0, ["zero1_compile"])], stage=2)[0].passes == ("zero1_compile",)  # the same compile in ds
    assert default_schedule(3)[1] == CompileStep(5, ("zero3_compile", "prefetch", "selective_gather"), True, True)
    assert default_schedule(1) == (CompileStep(0, ("zero1_compile",)),)


def test_default_warmup_is_ds_zeros() -> None:
    selective = pytest.importorskip("ds_zero._compile.selective")
    assert selective.WARMUP_STEPS == DEEPSPEED_WARMUP_STEPS


Z3 = "zero3_compile"
_REFUSALS = {
    "requirement": ([(0, [Z3]), (3, ["prefetch"])], 3, PassContractError, r"'prefetch' \(step 3\) requires"),
    "unknown": ([(0, [Z3]), (3, ["selective_gather_"])], 3, ValueError, r"step 3 lists the unknown pass 'selective_"),
    "unregistered": ([(0, [print])], 3, ValueError, r"step 0 lists <built-in function print>, which is no registered"),
    "not_from_0": ([(1, [Z3])], 3, ValueError, r"the first step is 1; the schedule must begin at step 0"),
    "order": ([(0, [Z3]), (0, [Z3])], 3, ValueError, r"step 0 is listed after step 0"),
    "empty": ([], 3, ValueError, r"needs a step 0"),
    "not_a_list": ([(0, Z3)], 3, TypeError, r"the passes of step 0 must be a list"),
    "step_type": ([("0", [Z3])], 3, TypeError, r"must be an int >= 0"),
    # a ZeRO-3 step without zero3_compile would read the partitions as whole parameters
    "no_zero3": (
        [(0, [Z3]), (4, [])],
        3,
        ValueError,
        r"step 4 \(\[\]\) has no 'zero3_compile' at zero_optimization.stage=3",
    ),
    "zero3_at_2": (
        [(0, [Z3])],
        2,
        ValueError,
        r"'zero3_compile' \(step 0\) applies at zero_optimization.stage 3, not 2",
    ),
    "zero1_at_3": (
        [(0, ["zero1_compile"])],
        3,
        ValueError,
        r"\(step 0\) applies at zero_optimization.stage 1 or 2, not 3",
    ),
    "stage_0": ([(0, ["zero1_compile"])], 0, ValueError, r"apply at zero_optimization.stage 1, 2 or 3, not 0"),
    "no_zero12": ([(0, [])], 1, ValueError, r"step 0 \(\[\]\) has no 'zero1_compile' or 'zero2_compile'"),
    "offload_params": (
        [(0, [Z3, "offload_parameters"])],
        3,
        ValueError,
        r"use the config key zero_optimization.offload_param",
    ),
    "offload_adam": (
        [(0, [Z3, offload_adam_states.move_opt_states_sync])],
        3,
        ValueError,
        r"pass 'offload_adam_states_sync' \(step 0\).*zero_optimization.offload_optimizer",
    ),
    "offload_act": (
        [(0, [Z3, "offload_activation_floor"])],
        3,
        ValueError,
        r"activation_checkpointing.cpu_checkpointing",
    ),
    # DeepSpeed's contracts come first: one offload target per run
    "one_offload": ([(0, [Z3, "offload_parameters", "offload_adam_states_sync"])], 3, PassContractError, "conflicts"),
}


@pytest.mark.parametrize(("schedule", "stage", "error", "match"), _REFUSALS.values(), ids=_REFUSALS.keys())
def test_plan_refusals(schedule: Any, stage: int, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        plan_schedule(schedule, stage=stage)


@needs_zero
def test_user_passes_take_part_in_validation_and_are_refused(registry: None) -> None:
    def my_pass(gm: Any, *args: Any) -> Any:
        return gm

    engine = make_engine(tiny_net(0), base_config(zero_optimization={"stage": 1}, compile={"deepcompile": True}))
    engine.register_compile_pass("my_pass", my_pass, PassContract(requires=frozenset({"z3_gather_release"})))
    with pytest.raises(PassContractError, match=r"'my_pass' \(step 0\) requires"):
        plan_schedule([(0, ["zero1_compile", my_pass])], stage=1)
    engine.register_compile_pass("my_pass", my_pass)  # no contract: unconstrained, still not runnable in ds
    with pytest.raises(ValueError, match=r"pass 'my_pass' \(step 0\) is a user-registered pass: DeepSpeed runs"):
        engine.compile(schedule=[(0, ["zero1_compile", my_pass])])
    engine.register_compile_pass("prefetch", my_pass)  # a built-in name given another function
    with pytest.raises(ValueError, match=r"pass 'prefetch' \(step 0\) is a user-registered pass"):
        plan_schedule([(0, ["zero3_compile", "prefetch"])], stage=3)
    with pytest.raises(TypeError, match="fn must be callable"):
        engine.register_compile_pass("bad", 3)  # type: ignore[arg-type]
    assert not engine.is_compiled


@needs_zero
@pytest.mark.parametrize(
    ("stage", "schedule", "match"),
    [
        (1, [(0, ["zero3_compile"])], r"'zero3_compile' \(step 0\) applies at zero_optimization.stage 3, not 1"),
        (3, [(0, ["zero2_compile"])], r"'zero2_compile' \(step 0\) applies at zero_optimization.stage 1 or 2, not 3"),
        (3, [(0, ["zero3_compile"]), (2, ["prefetch"])], r"'prefetch' \(step 2\) requires"),
        (3, [(0, ["zero3_compile"]), (2, ["selective_gather"])], r"'selective_gather' \(step 2\) requires"),
        (3, [(0, ["zero3_compile", "offload_parameters"])], r"zero_optimization.offload_param"),
    ],
)
def test_engine_compile_refuses_before_compiling(stage: int, schedule: Any, match: str) -> None:
    cfg = base_config(zero_optimization={"stage": stage}, compile={"deepcompile": True})
    engine = make_engine(tiny_net(0), cfg)
    with pytest.raises(ValueError, match=match):
        engine.compile(backend="eager", schedule=schedule)
    assert not engine.is_compiled and engine.deepcompile_schedule == []


def _train(engine: Any) -> list[float]:
    out = []
    for x, y in batches(6, 4):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


@needs_zero
def test_zero1_schedule_trains_as_eager_and_shows_its_steps() -> None:
    torch._dynamo.reset()
    cfg = base_config(zero_optimization={"stage": 1}, compile={"deepcompile": True})
    eager = _train(make_engine(tiny_net(0), cfg))
    engine = make_engine(tiny_net(0), cfg)
    engine.compile(backend="aot_eager", schedule=[(0, [zero_1_and_2_compile.add_z1_reduce]), (3, ["zero1_compile"])])
    assert engine.is_compiled and engine.is_deepcompile_active()
    assert _train(engine) == pytest.approx(eager, rel=1e-5, abs=1e-6)
    # compiled once (every step the same graphs at stage 1), each gradient's hand-over to ZeRO in its backward graph
    lines = engine.deepcompile_schedule
    num_params = sum(p.requires_grad for p in engine.module.parameters())
    assert lines[:3] == [
        "step 0: zero1_compile",
        "step 3: zero1_compile",
        f"backward 0: {num_params} gradient reductions",
    ]
    assert len(lines) == 3 + num_params and all(" reduce  " in line for line in lines[3:]), lines


def test_schedule_without_deepcompile_warns_and_compiles() -> None:
    engine = make_engine(tiny_net(0), base_config())
    with pytest.warns(UserWarning, match=re.escape("schedule=...) has no effect without compile.deepcompile: true")):
        engine.compile(backend="eager", schedule=[(0, ["zero3_compile"])])
    assert engine.is_compiled and engine.deepcompile_schedule == []
