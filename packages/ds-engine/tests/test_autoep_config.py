"""`expert_parallel` (AutoEP): the section's keys and checks, `explain`'s account of the conversion, and the
layouts initialize() refuses before converting anything (single process; nothing is downloaded)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

from ds_engine._parallel.autoep import apply_autoep
from ds_engine._plan.dist_info import DistInfo
from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.config._expert_parallel_section import ExpertParallelConfig
from ds_engine.explain import explain

pytest.importorskip("ds_parallel", reason="AutoEP needs ds-parallel: pip install 'ds-engine[parallel]'")
transformers = pytest.importorskip("transformers")


def _mixtral() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
    )  # fmt: skip
    return transformers.MixtralForCausalLM(cfg)


def test_deepspeed_defaults_and_given_null_expert_w3() -> None:
    section = ExpertParallelConfig()
    assert (section.enabled, section.autoep_size, section.top_k, section.score_func, section.route_scale) == (
        False, 1, "auto", "auto", 1.0,
    )  # fmt: skip
    assert "expert_w3" in ExpertParallelConfig(expert_w3=None).model_fields_set  # null given: gate+up fused


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"autoep_size": 0}, r"autoep_size=0 must be >= 1"),
        ({"top_k": 0}, r"top_k=0 must be >= 1"),
        ({"expert_w1": "a.b"}, r"expert_w1='a.b' must be a non-empty direct attribute name"),
        ({"row_weighting_impl": "fused"}, r"row_weighting_impl='fused' runs only inside the DeepEP exchange"),
        ({"expert_activation": "relu"}, r"expert_parallel.expert_activation"),
    ],
)
def test_bad_values_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=message):
        DeepSpeedConfig({"train_batch_size": 1, "expert_parallel": section})


@pytest.mark.parametrize("value", [0.0, False, "1e-3", [1e-3]])
def test_load_balancing_is_refused_and_a_given_null_is_recorded(value: object) -> None:
    with pytest.raises(
        DeepSpeedConfigError, match=rf"load_balance_coeff={re.escape(repr(value))} .*expert_bias.*null or omit"
    ):
        DeepSpeedConfig({"train_batch_size": 1, "expert_parallel": {"load_balance_coeff": value}})
    given = DeepSpeedConfig({"train_batch_size": 1, "expert_parallel": {"load_balance_coeff": None}})
    assert given.expert_parallel_config._load_balance_coeff_explicit is True
    assert ExpertParallelConfig()._load_balance_coeff_explicit is False


def test_explain_lists_the_blocks_and_where_each_expert_lives() -> None:
    config = DeepSpeedConfig(
        {"train_batch_size": 4, "expert_parallel": {"enabled": True, "autoep_size": 2, "preset_model": "mixtral"}},
        world_size=2,
    )
    model = _mixtral()
    text = explain(config, device_type="cpu", model=model)
    assert "expert-parallel groups [[0, 1]]" in text
    assert "model.layers.1.mlp: 4 experts, top_k 2, softmax" in text
    assert "ep rank 0: experts 0-1, ep rank 1: experts 2-3" in text
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"  # looked at, not converted


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tp_size=2, zero_stage=1, pipeline=False), r"tensor_parallel.autotp_size=2 must divide the stage size"),
        (
            dict(tp_size=1, zero_stage=3, pipeline=False, zero_config=SimpleNamespace(zero_hpz_partition_size=2)),
            r"stage=3 does not support hpZeRO .*zero_optimization.zero_hpz_partition_size=2",
        ),
        (
            dict(tp_size=1, zero_stage=3, pipeline=False, zero_config=SimpleNamespace(mics_shard_size=2)),
            r"stage=3 does not support MiCS \(zero_optimization.mics_shard_size=2\)",
        ),
        (
            dict(tp_size=1, zero_stage=3, pipeline=False, zero_config=SimpleNamespace(zero_quantized_gradients=True)),
            r"stage=3 does not support quantized gradients \(zero_optimization.zero_quantized_gradients",
        ),
        (dict(tp_size=1, zero_stage=1, pipeline=True), r"expert_parallel.enabled: AutoEP converts a plain model"),
    ],
)
def test_unsupported_layouts_are_refused_before_conversion(kwargs: dict, message: str) -> None:
    model = _mixtral()
    with pytest.raises(ValueError, match=message):
        apply_autoep(model, ExpertParallelConfig(enabled=True), DistInfo(), **kwargs)
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_folding_with_autotp_is_refused_at_zero_stage_3_naming_the_key() -> None:
    model = _mixtral()
    with pytest.raises(ValueError, match=r"zero_optimization.stage=3"):
        apply_autoep(
            model, ExpertParallelConfig(enabled=True, autoep_size=2), DistInfo(world_size=4, dp_world_size=2),
            tp_size=2, zero_stage=3, pipeline=False,
        )  # fmt: skip
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"


def test_a_parameter_list_given_before_conversion_is_replaced_by_the_converted_models() -> None:
    model = _mixtral()
    given = list(model.parameters())
    report, params = apply_autoep(
        model, ExpertParallelConfig(enabled=True), DistInfo(), tp_size=1, zero_stage=0, pipeline=False,
        model_parameters=given,
    )  # fmt: skip
    assert report.preset == "mixtral" and len(report.layers) == 2
    assert {id(p) for p in params} == {id(p) for p in model.parameters()}


def test_an_optimizer_built_before_conversion_is_refused_before_it() -> None:
    model = _mixtral()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"the optimizer passed to initialize\(\) holds the MoE routers'"):
        apply_autoep(
            model, ExpertParallelConfig(enabled=True), DistInfo(), tp_size=1, zero_stage=0, pipeline=False,
            client_optimizer=optimizer,
        )  # fmt: skip
    assert type(model.model.layers[0].mlp).__name__ == "MixtralSparseMoeBlock"
