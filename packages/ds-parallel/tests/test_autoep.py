"""AutoEP in one process: presets, detection, and each routing option against plain-PyTorch references.

Models are tiny and built from configs (nothing is downloaded). At autoep_size 1 a converted block must
compute what the Hugging Face block computes; with routing overrides, what a hand-written top-k MoE over
the same weights computes.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ds_parallel.autoep import PRESETS, AutoEPMoELayer, AutoEPOptions, TopKRouter, convert_moe_model

transformers = pytest.importorskip("transformers")

_SMALL = dict(vocab_size=32, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


def _mixtral() -> Any:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**_SMALL, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg)


def _qwen2_moe() -> Any:
    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(
        **_SMALL,
        intermediate_size=24,
        moe_intermediate_size=12,
        shared_expert_intermediate_size=20,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
    )
    return transformers.Qwen2MoeForCausalLM(cfg)


def _qwen3_moe() -> Any:
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(
        **_SMALL, intermediate_size=24, moe_intermediate_size=12, num_experts=4, num_experts_per_tok=2, head_dim=8
    )
    return transformers.Qwen3MoeForCausalLM(cfg)


def _deepseek_v2() -> Any:
    torch.manual_seed(0)
    cfg = transformers.DeepseekV2Config(
        **_SMALL,
        intermediate_size=24,
        moe_intermediate_size=12,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=1.5,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    )
    return transformers.DeepseekV2ForCausalLM(cfg)


def _deepseek_v3() -> Any:
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(
        **_SMALL,
        intermediate_size=24,
        moe_intermediate_size=12,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    )
    model = transformers.DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():  # HF initializes the router and its correction bias to zeros; make routing non-trivial
        for layer in model.model.layers[1:]:
            layer.mlp.gate.weight.normal_(0, 0.5)
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.1)
    return model


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids).logits


@pytest.mark.parametrize(
    ("build", "preset", "num_blocks"),
    [
        (_mixtral, "mixtral", 2),
        (_qwen2_moe, "qwen3_moe", 2),
        (_qwen3_moe, "qwen3_moe", 2),
        (_deepseek_v2, "deepseek_v2", 1),
        (_deepseek_v3, "deepseek_v3", 1),
    ],
)
def test_conversion_at_ep1_computes_what_the_hf_model_computes(build: Any, preset: str, num_blocks: int) -> None:
    model = build()
    ref = copy.deepcopy(model)
    report = convert_moe_model(model, AutoEPOptions())  # preset picked from model.config.model_type
    assert report.preset == preset and len(report.layers) == num_blocks
    assert sum(isinstance(m, AutoEPMoELayer) for m in model.modules()) == num_blocks
    ids = torch.randint(0, 32, (2, 7), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(_logits(model, ids), _logits(ref, ids), rtol=1e-5, atol=1e-5)


def test_deepseek_v3_resolves_group_routing_and_scale_from_the_model_config() -> None:
    model = _deepseek_v3()
    (spec,) = convert_moe_model(model, AutoEPOptions(preset_model="deepseek_v3")).layers
    assert (spec.score_func, spec.num_expert_groups, spec.num_limited_groups, spec.route_scale) == (
        "sigmoid",
        4,
        2,
        2.5,
    )
    assert spec.shared_experts_name == "shared_experts" and spec.moe_module_name == "model.layers.1.mlp"


def _reference_moe(
    x: torch.Tensor, gate_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, **route: Any
) -> torch.Tensor:
    """A token-by-token MoE: score, choose, weight, run each chosen expert, sum."""
    ffn = down.shape[2]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        logits = gate_w @ x[t]
        scores = torch.sigmoid(logits) if route["score_func"] == "sigmoid" else torch.softmax(logits, 0)
        chosen = sorted(range(len(scores)), key=lambda e: -float(scores[e]))[: route["top_k"]]
        w = scores[chosen]
        if route["route_norm"]:
            w = w / w.sum()
        w = w * route["route_scale"]
        for weight, e in zip(w, chosen, strict=True):
            pre = route.get("score_apply") == "pre"  # weight the expert's input instead of its output
            xin = weight * x[t] if pre else x[t]
            h = F.silu(gate_up[e, :ffn] @ xin) * (gate_up[e, ffn:] @ xin)
            out[t] += down[e] @ h if pre else weight * (down[e] @ h)
    return out


@pytest.mark.parametrize(
    "route",
    [
        dict(score_func="softmax", top_k=2, route_norm=True, route_scale=1.0),
        dict(score_func="sigmoid", top_k=1, route_norm=False, route_scale=1.0),
        dict(score_func="sigmoid", top_k=3, route_norm=True, route_scale=0.5),
        dict(score_func="softmax", top_k=2, route_norm=False, route_scale=2.0),
        dict(score_func="softmax", top_k=2, route_norm=True, route_scale=1.0, score_apply="pre"),
    ],
)
def test_routing_options_are_honoured(route: dict[str, Any]) -> None:
    model = _mixtral()
    block = model.model.layers[0].mlp
    gate_w, gate_up, down = (
        t.detach().clone() for t in (block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj)
    )
    opts = AutoEPOptions(preset_model="mixtral", **route)
    convert_moe_model(model, opts)
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(2))
    got = model.model.layers[0].mlp(x).reshape(10, 16)
    torch.testing.assert_close(
        got, _reference_moe(x.reshape(10, 16), gate_w, gate_up, down, **route), rtol=1e-5, atol=1e-6
    )


@pytest.mark.parametrize("group_score", ["max", "top2_sum"])
def test_group_limited_routing_chooses_only_within_the_best_groups(group_score: str) -> None:
    torch.manual_seed(3)
    router = TopKRouter(8, 8, top_k=2, score_func="sigmoid", route_norm=True, route_scale=1.0,
                        num_expert_groups=4, num_limited_groups=2, group_score_func=group_score)  # fmt: skip
    x = torch.randn(16, 8)
    weights, indices = router(x)
    scores = torch.sigmoid(router.gate(x)).detach()
    for t in range(16):
        groups = scores[t].view(4, 2)
        g = groups.max(1).values if group_score == "max" else groups.sum(1)  # two experts per group: top2 = sum
        best = set(torch.argsort(g, descending=True)[:2].tolist())
        allowed = [e for e in range(8) if e // 2 in best]
        want = sorted(allowed, key=lambda e: -float(scores[t, e]))[:2]
        assert sorted(indices[t].tolist()) == sorted(want)
        torch.testing.assert_close(weights[t].sum(), torch.tensor(1.0))


def test_presets_match_deepspeed_names_and_patterns() -> None:
    assert {"mixtral", "qwen3_moe", "qwen3_5_moe", "deepseek_v2", "deepseek_v3", "minimax_m3"} <= set(PRESETS)
    assert "qwen2_moe" in PRESETS["qwen3_moe"].hf_model_types
    assert (
        PRESETS["deepseek_v3"].num_experts_attr == "n_routed_experts" and PRESETS["deepseek_v3"].score_func == "sigmoid"
    )
    assert PRESETS["deepseek_v2"].group_score_func == "max" and not PRESETS["deepseek_v2"].route_norm
    assert all(p.moe_layer_pattern == r"model\.layers\.\d+\.mlp" for p in PRESETS.values())


@pytest.mark.parametrize(
    ("opts", "message"),
    [
        (AutoEPOptions(autoep_size=3), r"expert_parallel.autoep_size=3 must divide num_experts=4 .* \[1, 2, 4\]"),
        (AutoEPOptions(preset_model="gpt"), r"expert_parallel.preset_model='gpt' is not a preset"),
        (AutoEPOptions(top_k=5), r"expert_parallel.top_k=5 must be between 1 and num_experts=4"),
        (AutoEPOptions(num_expert_groups=2), r"num_expert_groups \(2\) and num_limited_groups \(None\) must be set"),
        (  # overrides apply to the preset the model_type picks
            AutoEPOptions(moe_layer_pattern="blocks", router_pattern="router"),
            r"no MoE block found in the model; tried mixtral: moe_layer_pattern='blocks', router='router'",
        ),
    ],
)
def test_bad_options_are_refused_naming_the_key(opts: AutoEPOptions, message: str) -> None:
    model = _mixtral()
    with pytest.raises(ValueError, match=message):
        convert_moe_model(model, opts)


def test_frozen_experts_stay_frozen_and_the_router_keeps_its_flag() -> None:
    model = _mixtral()
    block = model.model.layers[0].mlp
    block.experts.gate_up_proj.requires_grad_(False)
    convert_moe_model(model, AutoEPOptions())
    layer = model.model.layers[0].mlp
    assert [layer.experts.w1.requires_grad, layer.experts.w2.requires_grad, layer.experts.w3.requires_grad] == [
        False,
        True,
        False,
    ]
    assert layer.router.gate.weight.requires_grad


@pytest.mark.parametrize("build", [_mixtral, _qwen2_moe])
def test_layers_mark_deepspeeds_zero3_placement_families(build: Any) -> None:
    """Experts are partitioned over their expert-data-parallel group at ZeRO-3, the rest (router, shared experts)
    over the data-parallel group: DeepSpeed's marks, read by ds-zero."""
    model = build()
    convert_moe_model(model, AutoEPOptions())
    layers = [m for m in model.modules() if isinstance(m, AutoEPMoELayer)]
    assert layers
    for layer in layers:
        for p in layer.experts.parameters():
            assert (p.ds_zero_placement_family, p.ds_zero_partition_group_name) == ("autoep_expert", "ep_size_1")
        dense = [*layer.router.parameters(), *(layer.shared_experts.parameters() if layer.shared_experts else ())]
        assert dense and all(p.ds_zero_placement_family == "replicated" for p in dense)


def test_an_fp32_router_routes_bf16_tokens_as_fp32_ones() -> None:
    torch.manual_seed(4)
    router = TopKRouter(8, 4, top_k=2, score_func="softmax", route_norm=True, route_scale=1.0)  # fp32 gate
    x = torch.randn(6, 8).to(torch.bfloat16)
    weights, indices = router(x)
    ref_weights, ref_indices = router(x.float())
    assert torch.equal(indices, ref_indices) and weights.dtype == torch.float32
    torch.testing.assert_close(weights, ref_weights)
