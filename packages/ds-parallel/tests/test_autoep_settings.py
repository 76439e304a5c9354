"""DeepSpeed's `AutoEPConfig` object: parsing the section, the topology and value checks, the per-block checks,
filling from a Hugging Face config, and that its conversion options convert a model as the ds path does."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ds_parallel.autoep import (
    AutoEPConfig,
    AutoEPOptions,
    convert_moe_model,
    fill_autoep_config_from_hf,
    parse_autoep_config,
    validate_autoep_config,
    validate_autoep_post_detection,
)


def test_parse_keeps_defaults_and_refuses_unknown_keys_and_load_balancing() -> None:
    assert parse_autoep_config(None) == AutoEPConfig()
    cfg = parse_autoep_config({"enabled": True, "autoep_size": 2, "expert_w3": None})
    assert (cfg.enabled, cfg.autoep_size, cfg.expert_tensor_parallel_size, cfg.expert_w3) == (True, 2, 1, None)
    assert AutoEPConfig().to_options().expert_w3 is AutoEPOptions().expert_w3  # unset: the preset's
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['autoep_sz'\]"):
        parse_autoep_config({"autoep_sz": 2})
    with pytest.raises(ValueError, match=r"load_balance_coeff=0\.01 is not supported"):
        parse_autoep_config({"load_balance_coeff": 0.01})
    assert parse_autoep_config({"load_balance_coeff": None}).load_balance_coeff is None


def _on(**kw: Any) -> AutoEPConfig:
    return AutoEPConfig(enabled=True, autoep_size=kw.pop("autoep_size", 2), **kw)


@pytest.mark.parametrize(
    ("cfg", "topology", "message"),
    [
        (_on(score_apply="mid"), {}, r"expert_parallel.score_apply must be one of"),
        (_on(comm_backend="nccl"), {}, r"comm_backend must be one of"),
        (_on(gate_up_impl="fused", use_grouped_mm=False), {}, "needs use_grouped_mm=true"),
        (_on(row_weighting_impl="fused"), {}, "DeepEP route"),
        (_on(comm_backend="deepep"), {}, "comm_max_tokens_per_rank must be positive"),
        (_on(comm_num_sm=0), {}, r"comm_num_sm must be an integer >= 1, got 0"),
        (_on(combine_impl="fused_weighted_sum"), {"tp_size": 2}, "autotp_size=1"),
        (_on(async_split_plan=True), {"tp_size": 2}, "async_split_plan does not support"),
        (_on(preset_model="gpt9"), {}, r"preset_model='gpt9' is not a preset"),
        (_on(expert_activation="relu"), {}, "expert_activation must be one of"),
        (_on(num_expert_groups=2, num_limited_groups=3), {}, r"num_limited_groups \(3\) must be <="),
        (_on(router_pattern="mlp.gate"), {}, "direct attribute name"),
        (_on(expert_w3=""), {}, "expert_w3 must be a non-empty string"),
        (_on(routed_scaling_factor="big"), {}, "routed_scaling_factor must be a number"),
        (_on(autoep_size=3), {}, r"expert-width values: \[1, 2, 4\]"),
        (_on(expert_tensor_parallel_size=2), {}, "reserved"),
        (AutoEPConfig(validate_folding_routing=1), {}, "validate_folding_routing must be a boolean"),  # type: ignore[arg-type]
        (AutoEPConfig(load_balance_coeff=0.0), {}, "load_balance_coeff=0.0"),
    ],
)
def test_validate_names_the_key_at_fault(cfg: AutoEPConfig, topology: dict, message: str) -> None:
    sizes = {"world_size": 4, "pp_size": 1, "tp_size": 1, "sp_size": 1} | topology
    with pytest.raises(ValueError, match=message):
        validate_autoep_config(cfg, **sizes)


def test_validate_accepts_valid_layouts() -> None:
    validate_autoep_config(_on(), world_size=8, pp_size=2, tp_size=1, sp_size=1, deepcompile_enabled=True)
    validate_autoep_config(_on(autoep_size=4), world_size=8, pp_size=1, tp_size=2, sp_size=1)
    validate_autoep_config(AutoEPConfig(score_apply="mid"), world_size=3, pp_size=1, tp_size=1, sp_size=1)


def _spec(num: int, **kw: Any) -> SimpleNamespace:
    return SimpleNamespace(moe_module_name="model.layers.0.mlp", num_experts=num, score_apply="post", **kw)


def test_post_detection_checks_each_block() -> None:
    validate_autoep_post_detection(_on(autoep_size=4), [_spec(8)])
    with pytest.raises(ValueError, match=r"autoep_size=16 exceeds num_experts=8 .*\[1, 2, 4, 8\]"):
        validate_autoep_post_detection(_on(autoep_size=16), [_spec(8)])
    with pytest.raises(ValueError, match=r"num_experts=6 .* not divisible by expert_parallel.autoep_size=4"):
        validate_autoep_post_detection(_on(autoep_size=4), [_spec(6)])
    with pytest.raises(ValueError, match="num_limited_groups requires num_expert_groups"):
        validate_autoep_post_detection(_on(num_limited_groups=1), [_spec(8)])
    with pytest.raises(ValueError, match=r"num_expert_groups \(3\) must divide num_experts \(8\)"):
        validate_autoep_post_detection(_on(), [_spec(8, num_expert_groups=3, num_limited_groups=1)])
    with pytest.raises(ValueError, match='needs score_apply="post"'):
        validate_autoep_post_detection(_on(combine_impl="fused_weighted_sum", score_apply="pre"), [_spec(8)])
    validate_autoep_post_detection(AutoEPConfig(autoep_size=16), [_spec(8)])  # disabled: nothing checked


def test_fill_from_hf_fills_only_what_is_unset() -> None:
    hf = SimpleNamespace(n_group=4, topk_group=2, routed_scaling_factor=2.5)
    cfg = AutoEPConfig(num_limited_groups=1)
    fill_autoep_config_from_hf(cfg, hf)
    assert (cfg.num_expert_groups, cfg.num_limited_groups, cfg.route_scale) == (4, 1, 2.5)
    kept = AutoEPConfig(routed_scaling_factor=1.0)
    fill_autoep_config_from_hf(kept, hf)
    assert kept.route_scale == 1.0
    fill_autoep_config_from_hf(kept, None)


def test_its_options_convert_a_model_that_computes_what_the_original_does() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    hf_cfg = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    model = transformers.MixtralForCausalLM(hf_cfg).eval()
    ids = torch.randint(0, 32, (2, 5))
    with torch.no_grad():
        want = model(ids).logits
    cfg = parse_autoep_config({"enabled": True, "autoep_size": 1, "preset_model": "mixtral"})
    validate_autoep_config(cfg, world_size=1, pp_size=1, tp_size=1, sp_size=1)
    report = convert_moe_model(model, cfg.to_options())
    validate_autoep_post_detection(cfg, list(report.layers))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
