"""The engine's offload queries with and without `offload_*` sections, answering as DeepSpeed 0.19.8's engine does.

`zero_offload_param()` / `zero_offload_optimizer()` hand back the section as given, None when absent (clients
test `is not None`); the derived queries (`zero_cpu_offload`, `zero_partial_offload`, ...) answer for an
absent section what they answer for `{"device": "none"}`, except `cpuadam_cores_perc`, where DeepSpeed's
engine itself falls back to 0.9 without a section and the section's own default is 0.8.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_comm import ConfigDeprecationWarning

pytest.importorskip("ds_zero", reason="ZeRO sections need ds-zero: pip install 'ds-engine[zero]'")


def _engine(section: dict[str, Any], **overrides: Any) -> Any:
    return make_engine(tiny_net(0), base_config(zero_optimization=section, **overrides))


def _answers(engine: Any) -> tuple[bool, bool, float, bool, float, bool]:
    return (
        engine.zero_cpu_offload(),
        engine.zero_use_cpu_optimizer(),
        engine.zero_partial_offload(),
        engine.super_offload(),
        engine.cpuadam_cores_perc(),
        engine.zero_nvme_offload_optimizer(),
    )


_NO_OFFLOAD = (False, False, 1.0, False, 0.9, False)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_without_sections(stage: int) -> None:
    engine = _engine({"stage": stage})
    assert engine.zero_offload_param() is None and engine.zero_offload_optimizer() is None
    assert _answers(engine) == _NO_OFFLOAD


def test_without_a_zero_section_at_all() -> None:
    engine = make_engine(tiny_net(0), base_config())
    assert engine.zero_offload_param() is None and engine.zero_offload_optimizer() is None
    assert _answers(engine) == _NO_OFFLOAD


@pytest.mark.parametrize("stage", [2, 3])
def test_explicit_null_sections_answer_as_absent_ones(stage: int) -> None:
    engine = _engine({"stage": stage, "offload_param": None, "offload_optimizer": None})
    assert engine.zero_offload_param() is None and engine.zero_offload_optimizer() is None
    assert _answers(engine) == _NO_OFFLOAD


def test_empty_sections_are_sections_with_device_none() -> None:
    engine = _engine({"stage": 3, "offload_param": {}, "offload_optimizer": {}})
    param, opt = engine.zero_offload_param(), engine.zero_offload_optimizer()
    assert param is not None and param.device == "none"
    assert opt is not None and opt.device == "none"
    # a given section's own default for cpuadam_cores_perc (DeepSpeed reads the attribute when there is one)
    assert _answers(engine) == (False, False, 1.0, False, 0.8, False)


def test_optimizer_offload_section_at_stage2() -> None:
    engine = _engine({"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": False}})
    opt = engine.zero_offload_optimizer()
    assert opt is not None and (opt.device, opt.pin_memory) == ("cpu", False)
    assert engine.zero_offload_param() is None
    assert _answers(engine) == (True, True, 1.0, False, 0.8, False)


@pytest.mark.filterwarnings("ignore:zero_optimization.offload_optimizer.(ratio|cpuadam_cores_perc)=")
def test_both_sections_at_stage3() -> None:
    section = {
        "stage": 3,
        "offload_param": {"device": "cpu"},
        "offload_optimizer": {"device": "cpu", "ratio": 0.5, "cpuadam_cores_perc": 0.25},
    }
    engine = _engine(section)
    param, opt = engine.zero_offload_param(), engine.zero_offload_optimizer()
    assert param is not None and param.device == "cpu"
    assert opt is not None and opt.device == "cpu"
    assert _answers(engine) == (True, True, 0.5, False, 0.25, False)


def test_deprecated_switches_give_cpu_sections() -> None:
    with pytest.warns(ConfigDeprecationWarning, match="'cpu_offload(_param)?' is deprecated"):
        engine = _engine({"stage": 3, "cpu_offload": True, "cpu_offload_param": True})
    assert engine.zero_offload_param().device == "cpu" and engine.zero_offload_optimizer().device == "cpu"
    assert engine.zero_cpu_offload() and engine.zero_use_cpu_optimizer()


@pytest.mark.parametrize("stage", [2, 3])
def test_absent_sections_train_exactly_as_device_none(stage: int) -> None:
    """The mechanism reads an absent section as `{"device": "none"}`: the same parameters, bit for bit."""
    models = [tiny_net(0), tiny_net(0)]
    sections = [{"stage": stage}, {"stage": stage, "offload_param": {}, "offload_optimizer": {"device": "none"}}]
    engines = [make_engine(m, base_config(zero_optimization=s)) for m, s in zip(models, sections, strict=True)]
    for x, y in batches(4, 4):
        for engine in engines:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    for engine in engines:
        engine.offload_states()  # refused only when parameter offload is on
        engine.reload_states()
    assert torch.equal(flat_params(models[0]), flat_params(models[1]))


def test_offload_states_still_refused_with_parameter_offload() -> None:
    engine = _engine({"stage": 3, "offload_param": {"device": "cpu"}})
    with pytest.raises(ValueError, match="offload_states\\(\\) is not supported with zero_optimization.offload_param"):
        engine.offload_states()
