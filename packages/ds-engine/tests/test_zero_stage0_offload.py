"""Offload sections at ZeRO stage 0.

`offload_param`: DeepSpeed 0.19.8 ignores it below stage 3, so ds warns once naming it and trains exactly as
stage 0 without it. `offload_optimizer` (or the legacy `cpu_offload`): DeepSpeed takes it, builds its CPU
optimizer for it and fails at the first step on an accelerator (the parameters are not on the CPU); ds
refuses it up front naming the key. A `"device": "none"` section asks for nothing and is accepted.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError

# The per-key warning comes from ds-zero's config model; without ds-zero, ds-engine logs one line for every
# stage-0 key instead (tested in test_optional_seams).
pytest.importorskip("ds_zero", reason="the stage-0 offload warning is ds-zero's config model's")

SECTIONS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("param_cpu", {"offload_param": {"device": "cpu"}}, ["offload_param"]),
    ("param_nvme", {"offload_param": {"device": "nvme", "nvme_path": "/tmp"}}, ["offload_param"]),
    ("legacy_cpu_offload_param", {"cpu_offload_param": True}, ["offload_param"]),
    ("optimizer_none", {"offload_optimizer": {"device": "none"}}, []),
]

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("optimizer_cpu", {"offload_optimizer": {"device": "cpu"}}, r"zero_optimization.offload_optimizer.device='cpu'"),
    (
        "optimizer_nvme",
        {"offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}, "offload_param": {"device": "cpu"}},
        r"zero_optimization.offload_optimizer.device='nvme'",
    ),
    ("legacy_cpu_offload", {"cpu_offload": True}, r"zero_optimization.cpu_offload=True"),
]


def _messages(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "has no effect at stage" in str(w.message)]


@pytest.mark.parametrize(("section", "match"), [pytest.param(s, m, id=i) for i, s, m in REFUSED])
def test_stage0_optimizer_offload_is_refused_naming_the_key(section: dict[str, Any], match: str) -> None:
    model = tiny_net(0)
    before = flat_params(model)
    with pytest.raises(DeepSpeedConfigError, match=match + r": optimizer offload needs ZeRO stage 1, 2 or 3, but "):
        make_engine(model, base_config(zero_optimization={"stage": 0, **section}))
    assert torch.equal(flat_params(model), before)


@pytest.mark.parametrize(("section", "keys"), [pytest.param(s, k, id=i) for i, s, k in SECTIONS])
@pytest.mark.filterwarnings("ignore:config key 'cpu_offload_param' is deprecated")
def test_stage0_param_offload_warns_once_and_resolves_to_none(section: dict[str, Any], keys: list[str]) -> None:
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = DeepSpeedConfig(base_config(zero_optimization={"stage": 0, **section}))
    messages = _messages(record)
    assert len(messages) == len(keys), messages
    for key in keys:
        assert sum(m.startswith(f"zero_optimization.{key} has no effect at stage 0") for m in messages) == 1
    assert cfg.zero.stage == 0
    assert (cfg.zero.offload_optimizer_device, cfg.zero.offload_param_device) == ("none", "none")


@pytest.mark.parametrize(("section", "keys"), [pytest.param(s, k, id=i) for i, s, k in SECTIONS])
@pytest.mark.filterwarnings("ignore:config key 'cpu_offload_param' is deprecated")
def test_stage0_param_offload_trains_exactly_as_stage0_without_it(section: dict[str, Any], keys: list[str]) -> None:
    # The default optimizer choice (no torch_adam): with offload in effect it would be a CPU Adam.
    config = base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    plain_model, offload_model = tiny_net(0), tiny_net(0)
    plain = make_engine(plain_model, {**config, "zero_optimization": {"stage": 0}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        ignored = make_engine(offload_model, {**config, "zero_optimization": {"stage": 0, **section}})
    assert type(ignored.optimizer) is type(plain.optimizer)
    assert not ignored.zero_cpu_offload() and not ignored.zero_use_cpu_optimizer()
    assert ignored.zero_optimization_stage() == 0
    for x, y in batches(5, 4):
        for engine in (plain, ignored):
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    assert torch.equal(flat_params(offload_model), flat_params(plain_model))
