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
from collections.abc import Mapping
from typing import Literal

__all__ = [
    "PRESETS",
    "MoEModelPreset",
    "PresetAdapter",
    "get_preset_adapter",
    "preset_for_model_type",
    "unsupported_preset_for_hf_model_type",
]

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
    unsupported_hf_model_type_notes: Mapping[str, str] = dataclasses.field(default_factory=dict)
    """Model types of the same family AutoEP cannot convert as they are (a multimodal wrapper), with what to do."""


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
        unsupported_hf_model_type_notes={
            "qwen3_5_moe": "AutoEP converts the Qwen3.5 text backbone; pass the text model (model_type "
            "'qwen3_5_moe_text')"
        },
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
        unsupported_hf_model_type_notes={
            "minimax_m3_vl": "AutoEP converts the MiniMax-M3 text backbone; pass the text model (model_type "
            "'minimax_m3_vl_text')"
        },
    ),
}


def preset_for_model_type(model_type: str | None) -> str | None:
    """The preset picked for a Hugging Face `model_type`, or None."""
    for name, preset in PRESETS.items():
        if model_type in preset.hf_model_types:
            return name
    return None


def unsupported_preset_for_hf_model_type(model_type: str | None) -> tuple[str, MoEModelPreset] | None:
    """(preset name, preset) whose family has `model_type` but cannot convert it as it is (see the preset's
    `unsupported_hf_model_type_notes`), or None."""
    for name, preset in PRESETS.items():
        if model_type in preset.unsupported_hf_model_type_notes:
            return name, preset
    return None


class PresetAdapter:
    """The model-compatibility check a preset runs before conversion (DeepSpeed's preset adapter)."""

    def validate_compatibility(self, preset_name: str, preset: MoEModelPreset, model_config: object) -> None:
        """Raise when the model's `model_type` is one the preset's family cannot convert as it is.

        Raises:
            ValueError: names the model type, the preset and what to pass instead.
        """
        model_type = getattr(model_config, "model_type", None)
        note = preset.unsupported_hf_model_type_notes.get(model_type) if isinstance(model_type, str) else None
        if note is not None:
            raise ValueError(
                f"expert_parallel: model_type {model_type!r} is not supported by preset {preset_name!r}: {note}"
            )


_ADAPTER = PresetAdapter()


def get_preset_adapter(adapter_name: str) -> PresetAdapter:
    """The adapter of a preset (every preset and "default" share ds's one adapter).

    Raises:
        ValueError: `adapter_name` is neither a preset nor "default".
    """
    if adapter_name != "default" and adapter_name not in PRESETS:
        raise ValueError(
            f"unknown AutoEP preset adapter {adapter_name!r}; choose 'default' or one of {sorted(PRESETS)}"
        )
    return _ADAPTER
