"""AutoEP presets: where a Hugging Face model family keeps its MoE block, router, experts and routing rule.

A preset names children by attribute (`router_pattern`, `experts_pattern`) under every module whose path
fully matches `moe_layer_pattern`, and the model-config attributes that hold the expert count and top-k.
Expert weights are "fused_3d" (one `[E, ...]` tensor per projection, Transformers 5) or "module_list" (one
module per expert with `gate_proj`/`up_proj`/`down_proj`). The names and routing defaults are DeepSpeed
0.19.8's for the same preset names, so a config written for DeepSpeed picks the same layers here.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Literal

__all__ = ["PRESETS", "MoEModelPreset", "preset_for_model_type"]

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEModelPreset:
    """How one model family lays out an MoE block."""

    moe_layer_pattern: str
    """Regular expression a module path must fully match to be an MoE block."""
    router_pattern: str = "gate"
    """The block's router child; its `weight` is `[num_experts, hidden]`."""
    experts_pattern: str = "experts"
    """The block's experts child."""
    expert_storage: Literal["fused_3d", "module_list"] = "fused_3d"
    expert_w1: str = "gate_up_proj"
    """fused_3d: the gate (or fused gate+up when `expert_w3` is None) tensor; module_list: the gate child."""
    expert_w2: str = "down_proj"
    expert_w3: str | None = None
    """The up projection, or None when `expert_w1` holds gate and up fused along dim 1."""
    num_experts_attr: str = "num_local_experts"
    """Model-config attribute holding the number of routed experts."""
    top_k_attr: str = "num_experts_per_tok"
    score_func: Literal["softmax", "sigmoid"] = "softmax"
    score_apply: Literal["pre", "post"] = "post"
    """Multiply routing weights into the expert input ("pre") or output ("post")."""
    route_norm: bool = True
    """Renormalize the top-k weights to sum to one (a model config's `norm_topk_prob` wins)."""
    gate_bias: bool = False
    has_shared_experts: bool = False
    shared_experts_pattern: str = ""
    shared_experts_gate_pattern: str = ""
    """A `[1, hidden]` gate whose sigmoid scales the shared experts' output (Qwen-MoE)."""
    group_score_func: Literal["max", "top2_sum"] = "top2_sum"
    """How a group of experts is scored for group-limited routing (DeepSeek-V2: max, V3: sum of top 2)."""
    group_routing_from_config: bool = False
    """Read `n_group` / `topk_group` from the model config (DeepSeek)."""
    expert_activation: str = "swiglu"
    hf_model_types: tuple[str, ...] = ()
    """`model.config.model_type` values this preset is picked for when `preset_model` is not set."""


_BLOCK = r"model\.layers\.\d+\.mlp"

PRESETS: dict[str, MoEModelPreset] = {
    "mixtral": MoEModelPreset(moe_layer_pattern=_BLOCK, hf_model_types=("mixtral",)),
    "qwen3_moe": MoEModelPreset(
        moe_layer_pattern=_BLOCK,
        num_experts_attr="num_experts",
        has_shared_experts=True,
        shared_experts_pattern="shared_expert",
        shared_experts_gate_pattern="shared_expert_gate",
        hf_model_types=("qwen3_moe", "qwen2_moe"),
    ),
    "qwen3_5_moe": MoEModelPreset(
        moe_layer_pattern=_BLOCK,
        num_experts_attr="num_experts",
        has_shared_experts=True,
        shared_experts_pattern="shared_expert",
        shared_experts_gate_pattern="shared_expert_gate",
        hf_model_types=("qwen3_5_moe_text",),
    ),
    "deepseek_v2": MoEModelPreset(
        moe_layer_pattern=_BLOCK,
        num_experts_attr="n_routed_experts",
        route_norm=False,
        has_shared_experts=True,
        shared_experts_pattern="shared_experts",
        group_score_func="max",
        group_routing_from_config=True,
        hf_model_types=("deepseek_v2",),
    ),
    "deepseek_v3": MoEModelPreset(
        moe_layer_pattern=_BLOCK,
        num_experts_attr="n_routed_experts",
        score_func="sigmoid",
        route_norm=False,
        has_shared_experts=True,
        shared_experts_pattern="shared_experts",
        group_routing_from_config=True,
        hf_model_types=("deepseek_v3",),
    ),
    "minimax_m3": MoEModelPreset(
        moe_layer_pattern=_BLOCK,
        score_func="sigmoid",
        has_shared_experts=True,
        shared_experts_pattern="shared_experts",
        expert_activation="swiglu_oai",
        hf_model_types=("minimax_m3_vl_text",),
    ),
}


def preset_for_model_type(model_type: str | None) -> str | None:
    """The preset picked for a Hugging Face `model_type`, or None."""
    for name, preset in PRESETS.items():
        if model_type in preset.hf_model_types:
            return name
    return None
