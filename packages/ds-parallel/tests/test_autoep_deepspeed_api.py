"""AutoEP's DeepSpeed-shaped surface in one process, each against a plain reference: the split plan at
`ep_size` 1, the positional router and its counts, experts built from sizes, the score helpers, per-rank
repacking in every stored layout, the two-step `AutoEP` driver, and the refusal of unsupported model types."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_parallel.autoep import (
    AutoEP,
    AutoEPConfig,
    AutoEPMoELayer,
    SizedGroupedExperts,
    TokenChoiceTopKRouter,
    TopKRouter,
    apply_scores_before_experts_if_enabled,
    compute_split_plan,
    convert_moe_model,
    count_tokens_per_expert,
    detect_moe_layers,
    get_preset_adapter,
    repack_expert_weights,
    resolve_route_scale,
    resolve_score_apply_mode,
    unsupported_preset_for_hf_model_type,
)

transformers = pytest.importorskip("transformers")


def _mixtral(num_layers: int = 2) -> Any:
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=num_layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_local_experts=4,
        num_experts_per_tok=2,
    )
    return transformers.MixtralForCausalLM(cfg).eval()


def test_split_plan_at_one_rank_is_the_histogram_without_a_collective() -> None:
    experts = torch.tensor([[3, 0], [3, 1], [0, 3]])
    plan = compute_split_plan(experts, num_experts=4, ep_size=1, num_local_experts=4, ep_group=None)
    assert (plan.input_splits, plan.output_splits) == ([6], [6])
    assert plan.local_counts.tolist() == [2, 1, 0, 3] and plan.local_counts.dtype == torch.int32
    assert plan.local_counts_by_source.tolist() == [[2, 1, 0, 3]]
    with pytest.raises(ValueError, match="num_experts=4 must equal ep_size=2 \\* num_local_experts=1"):
        compute_split_plan(experts, num_experts=4, ep_size=2, num_local_experts=1, ep_group=None)


def test_positional_router_is_the_router_plus_its_counts() -> None:
    args = dict(top_k=2, score_func="sigmoid", route_norm=True, route_scale=2.5, gate_bias=True)
    ours = TokenChoiceTopKRouter(16, 8, 4, 2, 2, "sigmoid", True, 2.5, True)
    ref = TopKRouter(16, 8, num_expert_groups=4, num_limited_groups=2, **args)  # type: ignore[arg-type]
    ref.load_state_dict(ours.state_dict())
    x = torch.randn(10, 16)
    weights, indices, counts = ours(x)
    ref_weights, ref_indices = ref(x)
    torch.testing.assert_close(weights, ref_weights)
    assert torch.equal(indices, ref_indices)
    assert counts.dtype == torch.int32 and counts.tolist() == torch.bincount(indices.flatten(), minlength=8).tolist()
    with pytest.raises(ValueError, match="expert_bias"):
        ours(x, expert_bias=torch.zeros(8))


def test_sized_experts_compute_gated_mlps_per_expert() -> None:
    experts = SizedGroupedExperts(dim=8, hidden_dim=12, num_experts=3, use_grouped_mm=False)
    assert experts.w1.shape == (3, 12, 8) and experts.w2.shape == (3, 8, 12)
    for w in (experts.w1, experts.w2, experts.w3):
        nn.init.normal_(w, std=0.2)
    rows, counts = torch.randn(7, 8), torch.tensor([3, 0, 4])
    want = []
    for e, chunk in zip((0, 2), (rows[:3], rows[3:]), strict=True):
        hidden = F.silu(chunk @ experts.w1[e].T) * (chunk @ experts.w3[e].T)
        want.append(hidden @ experts.w2[e].T)
    torch.testing.assert_close(experts(rows, counts), torch.cat(want))
    with pytest.raises(ValueError, match="activation='gelu'"):
        SizedGroupedExperts(8, 12, 3, activation="gelu")


def test_score_helpers() -> None:
    rows = torch.randn(4, 3, dtype=torch.bfloat16)
    scores = torch.tensor([0.5, 1.0, 2.0, 0.0])
    pre = apply_scores_before_experts_if_enabled(rows, scores, "pre")
    torch.testing.assert_close(pre, (rows.float() * scores[:, None]).bfloat16())
    assert apply_scores_before_experts_if_enabled(rows, scores, "post") is rows
    spec = detect_moe_layers(_mixtral(1), AutoEPConfig(enabled=True).to_options())[2][0]
    assert (resolve_score_apply_mode(spec, "auto"), resolve_score_apply_mode(spec, "pre")) == ("post", "pre")
    for bad in ("2.5", True, float("nan")):
        with pytest.raises(ValueError, match="routed_scaling_factor must be a finite number"):
            resolve_route_scale(AutoEPConfig(routed_scaling_factor=bad), None)
    assert resolve_route_scale(AutoEPConfig(route_scale=3.0), None) == 3.0


def _fused(layout: str) -> nn.Module:
    """A fused_3d experts module holding gate+up in `layout` orientation, with known weights."""
    g = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(4, 6, 5, generator=g) for _ in range(2))
    down = torch.randn(4, 5, 6, generator=g)
    module = nn.Module()
    if layout == "gate_up_first":
        module.gate_up_proj = nn.Parameter(torch.cat([gate, up], dim=1))
        module.down_proj = nn.Parameter(down)
    else:
        module.gate_up_proj = nn.Parameter(torch.cat([gate, up], dim=1).transpose(1, 2).contiguous())
        module.down_proj = nn.Parameter(down.transpose(1, 2).contiguous())
    module.ref = (gate, down, up)
    return module


@pytest.mark.parametrize("layout", ["gate_up_first", "hidden_first"])
def test_repack_gives_each_rank_its_experts_in_linear_orientation(layout: str) -> None:
    experts = _fused(layout)
    spec = detect_moe_layers(_mixtral(1), AutoEPConfig(enabled=True).to_options())[2][0]
    for rank in range(2):
        got = repack_expert_weights(experts, spec, ep_rank=rank, ep_size=2)
        for mine, full in zip(got, experts.ref, strict=True):
            torch.testing.assert_close(mine, full[2 * rank : 2 * rank + 2])
    with pytest.raises(ValueError, match="ep_size=3 must divide num_experts=4"):
        repack_expert_weights(experts, spec, ep_rank=0, ep_size=3)


def test_driver_replaces_blocks_as_the_one_call_conversion_does() -> None:
    model, ref = _mixtral(), _mixtral()
    ids = torch.randint(0, 32, (2, 6))
    with torch.no_grad():
        want = ref(ids).logits
    auto_ep = AutoEP(model, AutoEPConfig(enabled=True, preset_model="mixtral"))
    specs = auto_ep.ep_parser()
    assert [s.moe_module_name for s in specs] == ["model.layers.0.mlp", "model.layers.1.mlp"]
    assert (specs[0].router_name, specs[0].experts_name, specs[0].expert_storage) == ("gate", "experts", "fused_3d")
    for spec in specs:
        assert isinstance(auto_ep.replace_moe_layer(spec, ep_size=1, ep_rank=0), AutoEPMoELayer)
    converted = copy.deepcopy(ref)
    convert_moe_model(converted, AutoEPConfig(enabled=True).to_options())
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(ids).logits, converted(ids).logits, rtol=0, atol=0)
    with pytest.raises(ValueError, match="autoep_size=8 exceeds num_experts=4"):
        AutoEP(_mixtral(1), AutoEPConfig(enabled=True, autoep_size=8)).ep_parser()


def test_wrapper_model_types_are_refused_with_what_to_pass() -> None:
    model = _mixtral(1)
    model.config.model_type = "qwen3_5_moe"
    assert unsupported_preset_for_hf_model_type("qwen3_5_moe")[0] == "qwen3_5_moe"  # type: ignore[index]
    assert unsupported_preset_for_hf_model_type("mixtral") is None
    with pytest.raises(ValueError, match="model_type 'qwen3_5_moe' is not supported.*'qwen3_5_moe_text'"):
        AutoEP(model, AutoEPConfig(enabled=True)).ep_parser()
    assert get_preset_adapter("mixtral") is get_preset_adapter("default")
    with pytest.raises(ValueError, match="unknown AutoEP preset adapter 'gpt'"):
        get_preset_adapter("gpt")


def test_router_logit_capture_is_refused_by_name() -> None:
    spec = detect_moe_layers(_mixtral(1), AutoEPConfig(enabled=True).to_options())[2][0]
    assert (spec.return_router_logits, spec.router_logits_capture_target) == (False, "none")
    with pytest.raises(ValueError, match="capturing router logits .* is not implemented in ds"):
        dataclasses.replace(spec, return_router_logits=True)
    with pytest.raises(ValueError, match="router_logits_capture_target='router'"):
        dataclasses.replace(spec, router_logits_capture_target="router")


def test_token_counts_are_the_histogram() -> None:
    experts = torch.randint(0, 7, (13, 3))
    counts = count_tokens_per_expert(experts, 9)
    assert counts.dtype == torch.int32 and counts.tolist() == torch.bincount(experts.flatten(), minlength=9).tolist()


def test_deepspeeds_constructor_builds_the_layer_from_the_source_block() -> None:
    """`AutoEPMoELayer(spec, source, ep_size, ep_rank, config)` computes the source block's function (1e-5), and
    the config's score_apply / route_norm / validate_folding_routing reach the layer."""
    model = _mixtral(1)
    spec = detect_moe_layers(model, AutoEPConfig(enabled=True).to_options())[2][0]
    block = model.model.layers[0].mlp
    layer = AutoEPMoELayer(spec, block, ep_size=1, ep_rank=0, config=AutoEPConfig(enabled=True))
    x = torch.randn(2, 5, spec.hidden_size)
    want = block(x)
    want = want[0] if isinstance(want, tuple) else want
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)
    assert layer._is_autoep_layer and layer.num_local_experts == spec.num_experts
    config = AutoEPConfig(enabled=True, score_apply="pre", validate_folding_routing=True)
    tuned = AutoEPMoELayer(spec, block, 2, 1, config)
    assert tuned.score_apply == "pre" and tuned.validate_folding_routing and tuned.local_experts == range(2, 4)
    with pytest.raises(TypeError, match="either the source block"):
        AutoEPMoELayer(spec)
    with pytest.raises(ValueError, match=r"load_balance_coeff=0.02 is not supported"):
        AutoEPMoELayer(spec, block, 1, 0, AutoEPConfig(enabled=True, load_balance_coeff=0.02))
    with pytest.raises(TypeError, match="either the source block"):
        AutoEPMoELayer(spec, block, router=layer.router, experts=layer.experts)
