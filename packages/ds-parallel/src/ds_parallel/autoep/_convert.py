"""`convert_moe_model`: find a Hugging Face model's MoE blocks and replace each with an `AutoEPMoELayer`.

Which preset: `preset_model` when given; else the one whose `hf_model_types` holds `model.config.model_type`;
else a custom preset from `moe_layer_pattern`; else every preset in turn. Explicit pattern/name options
override the chosen preset's. A block is one whose path fully matches the pattern and that has the router
child and an experts child with the expert weights; others (a DeepSeek model's dense first layers) are
left alone. Routing options resolve as DeepSpeed 0.19.8 resolves them: an explicit setting wins, then the
model config (`norm_topk_prob`, `routed_scaling_factor`, `n_group` / `topk_group`), then the preset.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ds_parallel.autoep._experts import EXPERT_ACTIVATIONS
from ds_parallel.autoep._layer import MoELayerSpec
from ds_parallel.autoep._parts import _expert_weights, _router_weight
from ds_parallel.autoep._presets import (
    PRESETS,
    MoEModelPreset,
    get_preset_adapter,
    preset_for_model_type,
    unsupported_preset_for_hf_model_type,
)
from ds_parallel.autoep._replace import replace_moe_block

__all__ = ["AutoEPOptions", "ConversionReport", "apply_overrides", "convert_moe_model", "detect_moe_layers"]

logger = logging.getLogger(__name__)

_KEY = "expert_parallel"
_UNSET: Any = object()


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoEPOptions:
    """The `expert_parallel` settings conversion reads (DeepSpeed's keys; None/"auto" = from model/preset)."""

    autoep_size: int = 1
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: Literal["auto", "pre", "post"] = "auto"
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    top_k: int | Literal["auto"] = "auto"
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    routed_scaling_factor: float | Literal["auto"] = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: Any = _UNSET
    """Unset: the preset's; None: gate and up fused in `expert_w1`; a name: the up projection."""
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: str | None = None


@dataclasses.dataclass(frozen=True)
class ConversionReport:
    """What conversion did: the preset, and each replaced block with its expert placement."""

    preset: str
    ep_size: int
    ep_rank: int
    layers: tuple[MoELayerSpec, ...]

    def lines(self) -> list[str]:
        """Human-readable summary (for logs and `explain`)."""
        out = [
            f"AutoEP preset {self.preset!r}: {len(self.layers)} MoE block(s) -> AutoEPMoELayer, ep_size {self.ep_size}"
        ]
        for spec in self.layers:
            local = spec.num_experts // self.ep_size
            placement = ", ".join(
                f"ep rank {r}: experts {r * local}-{(r + 1) * local - 1}" for r in range(self.ep_size)
            )
            out.append(
                f"  {spec.moe_module_name}: {spec.num_experts} experts, top_k {spec.top_k}, {spec.score_func} "
                f"(route_norm {spec.route_norm}, route_scale {spec.route_scale:g}, score_apply {spec.score_apply}"
                + (f", groups {spec.num_limited_groups}/{spec.num_expert_groups}" if spec.num_expert_groups else "")
                + (f", shared experts {spec.shared_experts_name!r}" if spec.shared_experts_name else "")
                + f"); {placement}"
            )
        return out


def apply_overrides(opts: AutoEPOptions, preset: MoEModelPreset) -> MoEModelPreset:
    """`preset` with the explicitly set name/pattern options of `opts` in place of its own."""
    changes: dict[str, Any] = {}
    for key, field in (
        ("moe_layer_pattern", "moe_layer_pattern"),
        ("router_pattern", "router_pattern"),
        ("expert_pattern", "experts_pattern"),
        ("expert_w1", "expert_w1"),
        ("expert_w2", "expert_w2"),
        ("num_experts_attr", "num_experts_attr"),
        ("top_k_attr", "top_k_attr"),
        ("has_shared_experts", "has_shared_experts"),
        ("shared_experts_pattern", "shared_experts_pattern"),
        ("shared_experts_gate_pattern", "shared_experts_gate_pattern"),
        ("expert_activation", "expert_activation"),
    ):
        value = getattr(opts, key)
        if value is not None:
            changes[field] = value
    if opts.expert_w3 is not _UNSET:
        changes["expert_w3"] = opts.expert_w3
    return dataclasses.replace(preset, **changes) if changes else preset


def _candidates(opts: AutoEPOptions, model_type: str | None) -> list[tuple[str, MoEModelPreset]]:
    if opts.preset_model is not None:
        if opts.preset_model not in PRESETS:
            raise ValueError(
                f"{_KEY}.preset_model={opts.preset_model!r} is not a preset; choose one of {sorted(PRESETS)} "
                "or describe the model with moe_layer_pattern/router_pattern/expert_pattern"
            )
        return [(opts.preset_model, apply_overrides(opts, PRESETS[opts.preset_model]))]
    unsupported = unsupported_preset_for_hf_model_type(model_type)
    if unsupported is not None:
        get_preset_adapter(unsupported[0]).validate_compatibility(*unsupported, SimpleNamespace(model_type=model_type))
    by_type = preset_for_model_type(model_type)
    if by_type is not None:
        return [(by_type, apply_overrides(opts, PRESETS[by_type]))]
    if opts.moe_layer_pattern is not None:
        return [("custom", apply_overrides(opts, MoEModelPreset(moe_layer_pattern=opts.moe_layer_pattern)))]
    return [(name, apply_overrides(opts, preset)) for name, preset in PRESETS.items()]


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{what} must be a positive integer, got {value!r}")
    return value


def _route_scale(opts: AutoEPOptions, model_config: Any) -> float:
    if opts.routed_scaling_factor != "auto":
        value, what = opts.routed_scaling_factor, f"{_KEY}.routed_scaling_factor"
    elif getattr(model_config, "routed_scaling_factor", None) is not None:
        value, what = model_config.routed_scaling_factor, "model.config.routed_scaling_factor"
    else:
        value, what = opts.route_scale, f"{_KEY}.route_scale"
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{what} must be a finite number, got {value!r}")
    return float(value)


def _resolve(
    name: str,
    family: str,
    preset: MoEModelPreset,
    opts: AutoEPOptions,
    cfg: Any,
    weights: tuple[torch.Tensor, ...],
    module: nn.Module,
) -> MoELayerSpec:
    w1, w2, _ = weights
    experts, router = getattr(module, preset.experts_pattern), getattr(module, preset.router_pattern)
    num_experts = getattr(cfg, preset.num_experts_attr, None) or w1.shape[0]
    top_k = opts.top_k if opts.top_k != "auto" else getattr(cfg, preset.top_k_attr, None)
    if top_k is None:
        raise ValueError(f"{_KEY}.top_k: model config has no {preset.top_k_attr!r}; set top_k (or top_k_attr)")
    top_k = _positive_int(top_k, f"{_KEY}.top_k")
    if family == "deepseek_v2":  # DeepSeek-V2 keeps its preset's choice over norm_topk_prob
        route_norm = opts.route_norm if opts.route_norm is not None else preset.route_norm
    elif opts.route_norm is not None:
        route_norm = opts.route_norm
    else:
        cfg_norm = getattr(cfg, "norm_topk_prob", None)
        route_norm = bool(cfg_norm) if cfg_norm is not None else preset.route_norm
    groups, limited = opts.num_expert_groups, opts.num_limited_groups
    if preset.group_routing_from_config and (
        family != "deepseek_v2" or getattr(cfg, "topk_method", None) == "group_limited_greedy"
    ):
        groups = groups or getattr(cfg, "n_group", None)
        limited = limited or getattr(cfg, "topk_group", None)
    if groups == 1 and limited == 1:  # one group holding every expert: plain top-k
        groups = limited = None
    if (groups is None) != (limited is None):
        raise ValueError(
            f"{_KEY}.num_expert_groups ({groups}) and num_limited_groups ({limited}) must be set together "
            f"(layer {name!r})"
        )
    if groups is not None and limited is not None and (num_experts % groups or not 1 <= limited <= groups):
        raise ValueError(
            f"{_KEY}.num_expert_groups={groups} must divide num_experts={num_experts} and num_limited_groups="
            f"{limited} must be between 1 and it (layer {name!r})"
        )
    if preset.expert_activation not in EXPERT_ACTIVATIONS:
        raise ValueError(
            f"{_KEY}.expert_activation={preset.expert_activation!r} is not one of {sorted(EXPERT_ACTIVATIONS)}"
        )
    return MoELayerSpec(
        moe_module_name=name,
        model_family=family,
        num_experts=int(num_experts),
        top_k=top_k,
        hidden_size=int(w2.shape[1]),
        ffn_hidden_size=int(w2.shape[2]),
        score_func=opts.score_func if opts.score_func != "auto" else preset.score_func,
        score_apply=opts.score_apply if opts.score_apply != "auto" else preset.score_apply,
        route_norm=route_norm,
        route_scale=_route_scale(opts, cfg),
        num_expert_groups=groups,
        num_limited_groups=limited,
        group_score_func=preset.group_score_func,
        expert_activation=preset.expert_activation,
        shared_experts_name=preset.shared_experts_pattern if preset.has_shared_experts else "",
        shared_experts_gate_name=preset.shared_experts_gate_pattern if preset.has_shared_experts else "",
        router_name=preset.router_pattern,
        experts_name=preset.experts_pattern,
        expert_storage="module_list" if isinstance(experts, nn.ModuleList) else "fused_3d",
        expert_w1_name="gate_proj" if isinstance(experts, nn.ModuleList) else preset.expert_w1,
        expert_w2_name="down_proj" if isinstance(experts, nn.ModuleList) else preset.expert_w2,
        expert_w3_name="up_proj" if isinstance(experts, nn.ModuleList) else preset.expert_w3,
        gate_bias=isinstance(getattr(router, "bias", None), torch.Tensor),
        has_shared_experts=preset.has_shared_experts,
    )


def detect_moe_layers(model: nn.Module, opts: AutoEPOptions) -> tuple[str, MoEModelPreset, list[MoELayerSpec]]:
    """The first candidate preset that matches at least one block, and the blocks it matches.

    Raises:
        ValueError: no block matches (names the patterns tried), or a resolved option is invalid.
    """
    cfg = getattr(model, "config", None)
    if getattr(cfg, "output_router_logits", False):
        raise ValueError(
            "expert_parallel.enabled: the model config has output_router_logits=True, whose auxiliary loss reads "
            "the original routers' logits, which AutoEP replaces; set model.config.output_router_logits=False"
        )
    tried = []
    for family, preset in _candidates(opts, getattr(cfg, "model_type", None)):
        pattern = re.compile(preset.moe_layer_pattern)
        specs = []
        for name, module in model.named_modules():
            if not pattern.fullmatch(name):
                continue
            experts, router = (
                getattr(module, preset.experts_pattern, None),
                getattr(module, preset.router_pattern, None),
            )
            if not isinstance(experts, nn.Module) or router is None or _router_weight(router) is None:
                continue
            weights = _expert_weights(experts, preset.expert_w1, preset.expert_w2, preset.expert_w3)
            if weights is not None:
                specs.append(_resolve(name, family, preset, opts, cfg, weights, module))
        if specs:
            return family, preset, specs
        tried.append(
            f"{family}: moe_layer_pattern={preset.moe_layer_pattern!r}, router={preset.router_pattern!r}, "
            f"experts={preset.experts_pattern!r}"
        )
    raise ValueError(
        "expert_parallel: no MoE block found in the model; tried "
        + "; ".join(tried)
        + ". Set expert_parallel.preset_model to the model's family or describe it with moe_layer_pattern, "
        "router_pattern and expert_pattern"
    )


def convert_moe_model(
    model: nn.Module, opts: AutoEPOptions, *, ep_rank: int = 0, ep_group: ProcessGroup | None = None
) -> ConversionReport:
    """Replace every detected MoE block of `model` in place; this rank keeps only its experts.

    Args:
        model: a Hugging Face (or alike) MoE model, full weights on every rank.
        opts: the `expert_parallel` settings; `opts.autoep_size` is the expert-parallel degree.
        ep_rank: this rank's place in the expert-parallel group.
        ep_group: the expert-parallel group (None only when `autoep_size` is 1).

    Raises:
        ValueError: no block found, or `autoep_size` does not divide a block's expert count (names both).
    """
    ep_size = _positive_int(opts.autoep_size, f"{_KEY}.autoep_size")
    family, preset, specs = detect_moe_layers(model, opts)
    for spec in specs:
        if spec.num_experts % ep_size:
            divisors = [d for d in range(1, spec.num_experts + 1) if spec.num_experts % d == 0]
            raise ValueError(
                f"{_KEY}.autoep_size={ep_size} must divide num_experts={spec.num_experts} of "
                f"{spec.moe_module_name!r}; choose one of {divisors}"
            )
    for spec in specs:
        replace_moe_block(model, spec, ep_size=ep_size, ep_rank=ep_rank, ep_group=ep_group)
    report = ConversionReport(preset=family, ep_size=ep_size, ep_rank=ep_rank, layers=tuple(specs))
    for line in report.lines():
        logger.info("%s", line)
    return report
