"""Offload sections at ZeRO stage 0: a warning naming the key, then exactly stage 0 without offload.

DeepSpeed accepts `offload_optimizer` / `offload_param` at stage 0 and ignores them, so a config toggled
between stages keeps its offload sections; ds warns that they have no effect there.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_engine.config import DeepSpeedConfig

# The per-key warning comes from ds-zero's config model; without ds-zero, ds-engine logs one line for every
# stage-0 key instead (tested in test_optional_seams).
pytest.importorskip("ds_zero", reason="the stage-0 offload warning is ds-zero's config model's")

SECTIONS: list[tuple[str, dict[str, Any], list[str]]] = [
    ("optimizer_cpu", {"offload_optimizer": {"device": "cpu"}}, ["offload_optimizer"]),
    ("param_cpu", {"offload_param": {"device": "cpu"}}, ["offload_param"]),
    (
        "both_nvme",
        {
            "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"},
            "offload_param": {"device": "nvme", "nvme_path": "/tmp"},
        },
        ["offload_optimizer", "offload_param"],
    ),
    ("legacy_cpu_offload", {"cpu_offload": True}, ["offload_optimizer"]),
]


def _messages(record: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in record if "has no effect at stage 0" in str(w.message)]


@pytest.mark.parametrize(("section", "keys"), [pytest.param(s, k, id=i) for i, s, k in SECTIONS])
def test_stage0_offload_warns_once_per_key_and_resolves_to_none(section: dict[str, Any], keys: list[str]) -> None:
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
@pytest.mark.filterwarnings("ignore:config key 'cpu_offload' is deprecated")
def test_stage0_offload_trains_exactly_as_stage0_without_it(section: dict[str, Any], keys: list[str]) -> None:
    # The default optimizer choice (no torch_adam): with offload in effect it would be a CPU Adam.
    config = base_config(optimizer={"type": "AdamW", "params": {"lr": 1e-2}})
    plain_model, offload_model = tiny_net(0), tiny_net(0)
    plain = make_engine(plain_model, {**config, "zero_optimization": {"stage": 0}})
    with pytest.warns(UserWarning, match="has no effect at stage 0"):
        ignored = make_engine(offload_model, {**config, "zero_optimization": {"stage": 0, **section}})
    assert type(ignored.optimizer) is type(plain.optimizer)
    assert not ignored.zero_cpu_offload() and not ignored.zero_use_cpu_optimizer()
    assert ignored.zero_optimization_stage() == 0
    for x, y in batches(5, 4):
        for engine in (plain, ignored):
            engine.backward(loss_fn(engine(x), y))
            engine.step()
    assert torch.equal(flat_params(offload_model), flat_params(plain_model))
