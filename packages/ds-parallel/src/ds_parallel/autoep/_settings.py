"""`AutoEPConfig`: DeepSpeed 0.19.8's mutable `expert_parallel` settings object, its parser and its checks.

DeepSpeed's own AutoEP code and tests build this object field by field (`AutoEPConfig(enabled=True, ...)`,
`parse_autoep_config(section)`), then validate it against the job's topology (`validate_autoep_config`) and,
after the MoE blocks are found, against each block (`validate_autoep_post_detection`). ds's engine reads the
section through its pydantic model instead; `to_options()` turns this object into the `AutoEPOptions`
conversion takes, so both paths convert a model the same way.

The checks are DeepSpeed's rules: topology (through `build_folding_spec` / `validate_folding_global`), the
value sets of the enum-like keys, direct attribute names, and the DeepEP/fused-combine combinations.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from ds_parallel.autoep._convert import _UNSET, AutoEPOptions
from ds_parallel.autoep._experts import EXPERT_ACTIVATIONS
from ds_parallel.autoep._folding import build_folding_spec, validate_folding_global
from ds_parallel.autoep._presets import PRESETS

__all__ = [
    "PRESET_MODELS",
    "AutoEPConfig",
    "fill_autoep_config_from_hf",
    "parse_autoep_config",
    "validate_autoep_config",
    "validate_autoep_post_detection",
]

logger = logging.getLogger(__name__)

#: The preset names `expert_parallel.preset_model` accepts (the presets themselves).
PRESET_MODELS = PRESETS

_CHOICES: dict[str, tuple[str, ...]] = {
    "score_apply": ("auto", "pre", "post"),
    "combine_impl": ("auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"),
    "row_weighting_impl": ("auto", "eager", "fused"),
    "gate_up_impl": ("separate", "fused"),
    "comm_backend": ("comm", "deepep"),
    "score_func": ("auto", "softmax", "sigmoid"),
}
_NAME_KEYS = (
    "expert_w1",
    "expert_w2",
    "num_experts_attr",
    "top_k_attr",
    "router_pattern",
    "expert_pattern",
    "shared_experts_pattern",
    "shared_experts_gate_pattern",
)


def _refuse_load_balance(value: object) -> NoReturn:
    raise ValueError(
        f"expert_parallel.load_balance_coeff={value!r} is not supported (it would register an expert_bias for "
        "auxiliary-loss-free load balancing, which DeepSpeed refuses too); set it to null or omit the key"
    )


@dataclasses.dataclass
class AutoEPConfig:
    """The `expert_parallel` section as DeepSpeed holds it (same field names and defaults).

    `expert_w3` left at its sentinel means "the preset's"; None means gate and up are fused in `expert_w1`.
    """

    enabled: bool = False
    autoep_size: int = 1
    expert_tensor_parallel_size: int = 1
    validate_folding_routing: bool = False
    async_split_plan: bool = False
    preset_model: str | None = None
    moe_layer_pattern: str | None = None
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    route_scale: float = 1.0
    score_apply: str = "auto"
    combine_impl: str = "auto"
    row_weighting_impl: str = "auto"
    gate_up_impl: str = "separate"
    comm_backend: str = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: str = "auto"
    top_k: int | str = "auto"
    load_balance_coeff: Any = None
    routed_scaling_factor: float | str = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: Any = _UNSET
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: str | None = None
    _load_balance_coeff_explicit: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)
    """Whether the parsed section named `load_balance_coeff` (DeepSpeed records it; only null is accepted)."""

    def to_options(self) -> AutoEPOptions:
        """The conversion settings (`convert_moe_model`'s) this section describes."""
        # getattr, not dataclasses.asdict: asdict deep-copies, and the "unset" sentinel must stay itself
        return AutoEPOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(AutoEPOptions)})


def parse_autoep_config(section: Mapping[str, Any] | None) -> AutoEPConfig:
    """The `expert_parallel` dict of a ds_config as an `AutoEPConfig`; absent keys keep their defaults.

    Raises:
        ValueError: `load_balance_coeff` is set to anything but null; a key that is not DeepSpeed's.
    """
    if not section:
        return AutoEPConfig()
    known = {f.name for f in dataclasses.fields(AutoEPConfig)}
    unknown = sorted(set(section) - known)
    if unknown:
        raise ValueError(f"expert_parallel: unknown key(s) {unknown}; the keys are {sorted(known)}")
    if section.get("load_balance_coeff") is not None:
        _refuse_load_balance(section["load_balance_coeff"])
    config = AutoEPConfig(**dict(section))
    config._load_balance_coeff_explicit = "load_balance_coeff" in section
    return config


def _check_names(config: AutoEPConfig) -> None:
    names = [(k, getattr(config, k)) for k in _NAME_KEYS]
    if config.expert_w3 is not _UNSET and config.expert_w3 is not None:
        names.append(("expert_w3", config.expert_w3))
    for key, value in names:
        if value is None:
            continue
        if not isinstance(value, str) or not value:
            raise ValueError(f"expert_parallel.{key} must be a non-empty string, got {value!r}")
        if "." in value:
            raise ValueError(f"expert_parallel.{key}={value!r} must be a direct attribute name (no dots)")


def _check_combinations(config: AutoEPConfig, tp_size: int) -> None:
    if config.async_split_plan and config.autoep_size > 1 and tp_size > 1:
        raise ValueError(
            "expert_parallel.async_split_plan does not support AutoEP+AutoTP folding; set "
            "tensor_parallel.autotp_size to 1 or disable async_split_plan"
        )
    if config.combine_impl == "fused_weighted_sum":
        if tp_size > 1 or config.expert_tensor_parallel_size > 1:
            raise ValueError(
                'expert_parallel.combine_impl="fused_weighted_sum" needs tensor_parallel.autotp_size=1 and '
                f"expert_tensor_parallel_size=1 (got {tp_size} and {config.expert_tensor_parallel_size}); leave "
                "combine_impl unset"
            )
        if config.comm_backend == "deepep" and config.autoep_size > 1:
            raise ValueError(
                'expert_parallel.combine_impl="fused_weighted_sum" cannot be used with comm_backend="deepep"; '
                "leave combine_impl unset"
            )
    if config.gate_up_impl == "fused" and not config.use_grouped_mm:
        raise ValueError(
            'expert_parallel.gate_up_impl="fused" needs use_grouped_mm=true; set it, or leave gate_up_impl unset'
        )
    if config.row_weighting_impl == "fused" and (config.comm_backend != "deepep" or config.autoep_size == 1):
        raise ValueError(
            'expert_parallel.row_weighting_impl="fused" runs only inside the DeepEP route (comm_backend="deepep" '
            "and autoep_size > 1); leave row_weighting_impl unset"
        )
    for key, low in (("comm_num_sm", 1), ("comm_qp_margin", 0), ("comm_max_tokens_per_rank", 0)):
        value = getattr(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(f"expert_parallel.{key} must be an integer >= {low}, got {value!r}")
    if config.comm_backend == "deepep" and config.comm_max_tokens_per_rank == 0:
        raise ValueError(
            "expert_parallel.comm_max_tokens_per_rank must be positive with comm_backend='deepep' (the most tokens "
            "one rank routes: micro batch * padded sequence length)"
        )


def validate_autoep_config(
    config: AutoEPConfig,
    world_size: int,
    pp_size: int,
    tp_size: int,
    sp_size: int,
    *,
    zero_stage: int = 0,
    deepcompile_enabled: bool = False,
    tp_preset_model: str | None = None,
    use_data_before_expert_parallel: bool = False,
    mpu: Any = None,
    zero_offload_optimizer: bool = False,
    zero_offload_param: bool = False,
) -> None:
    """Check `config` against the job's topology and DeepSpeed's value rules, before any group exists.

    Raises:
        ValueError: naming the `expert_parallel.<key>` (or topology size) at fault, the value and the fix.
    """
    if config.load_balance_coeff is not None:
        _refuse_load_balance(config.load_balance_coeff)
    for key in ("validate_folding_routing", "async_split_plan"):
        if not isinstance(getattr(config, key), bool):
            raise ValueError(f"expert_parallel.{key} must be a boolean, got {getattr(config, key)!r}")
    if not config.enabled:
        return
    for key, choices in _CHOICES.items():
        if getattr(config, key) not in choices:
            raise ValueError(f"expert_parallel.{key} must be one of {choices}, got {getattr(config, key)!r}")
    _check_combinations(config, tp_size)
    spec = build_folding_spec(
        world_size=world_size,
        pp_size=pp_size,
        tp_size=max(tp_size, 1),
        ep_size=config.autoep_size,
        etp_size=config.expert_tensor_parallel_size,
        mp_mode="tp" if tp_size > 1 else "sp",
    )
    validate_folding_global(
        spec,
        zero_stage=zero_stage,
        sp_size=sp_size,
        deepcompile_enabled=deepcompile_enabled,
        use_data_before_expert_parallel=use_data_before_expert_parallel,
        mpu=mpu,
        tp_preset=tp_preset_model,
        ep_preset=config.preset_model,
        zero_offload_optimizer=zero_offload_optimizer,
        zero_offload_param=zero_offload_param,
    )
    if config.preset_model is not None and config.preset_model not in PRESET_MODELS:
        raise ValueError(
            f"expert_parallel.preset_model={config.preset_model!r} is not a preset; choose one of "
            f"{sorted(PRESET_MODELS)}"
        )
    if config.expert_activation is not None and config.expert_activation not in EXPERT_ACTIVATIONS:
        raise ValueError(
            f"expert_parallel.expert_activation must be one of {tuple(EXPERT_ACTIVATIONS)}, "
            f"got {config.expert_activation!r}"
        )
    for key in ("num_expert_groups", "num_limited_groups"):
        value = getattr(config, key)
        if value is not None and value < 1:
            raise ValueError(f"expert_parallel.{key} must be >= 1, got {value}")
    groups, limited = config.num_expert_groups, config.num_limited_groups
    if groups is not None and limited is not None and limited > groups:
        raise ValueError(f"expert_parallel.num_limited_groups ({limited}) must be <= num_expert_groups ({groups})")
    _check_names(config)
    if config.has_shared_experts is not None and not isinstance(config.has_shared_experts, bool):
        raise ValueError(f"expert_parallel.has_shared_experts must be a boolean, got {config.has_shared_experts!r}")
    scale = config.routed_scaling_factor
    if scale != "auto" and (isinstance(scale, bool) or not isinstance(scale, int | float)):
        raise ValueError(f"expert_parallel.routed_scaling_factor must be a number or 'auto', got {scale!r}")
    if config.autoep_size == 1:
        logger.warning("expert_parallel.autoep_size=1: every rank holds every expert; no all-to-all is issued")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate_autoep_post_detection(config: AutoEPConfig, specs: Sequence[Any]) -> None:
    """Check each detected block (`MoELayerSpec`-like: `moe_module_name`, `num_experts`, `score_apply`, group
    routing) against the expert-parallel degree and the group-limited routing settings.

    Raises:
        ValueError: `autoep_size` exceeds or does not divide a block's expert count (lists the valid sizes); group
            routing is half set or does not divide the experts; fused combine with pre-scoring.
    """
    if not config.enabled:
        return
    ep = config.autoep_size
    for spec in specs:
        name, num = spec.moe_module_name, spec.num_experts
        if config.combine_impl == "fused_weighted_sum":
            apply = spec.score_apply if config.score_apply == "auto" else config.score_apply
            if apply != "post":
                raise ValueError(
                    f'expert_parallel.combine_impl="fused_weighted_sum" needs score_apply="post", but {name!r} '
                    f'resolves score_apply="{apply}"; leave combine_impl unset'
                )
        if ep > num:
            raise ValueError(
                f"expert_parallel.autoep_size={ep} exceeds num_experts={num} in layer {name!r}; each rank must own "
                f"at least one expert. Valid autoep_size values (divisors of {num}): {_divisors(num)}"
            )
        if num % ep:
            raise ValueError(
                f"num_experts={num} in layer {name!r} is not divisible by expert_parallel.autoep_size={ep}. "
                f"Suggested autoep_size values: {_divisors(num)}"
            )
        groups = getattr(spec, "num_expert_groups", None) or config.num_expert_groups
        limited = getattr(spec, "num_limited_groups", None) or config.num_limited_groups
        if groups is None:
            if limited is not None:
                raise ValueError(f"num_limited_groups requires num_expert_groups to be set in layer {name!r}")
            continue
        if groups < 1 or num % groups:
            raise ValueError(f"num_expert_groups ({groups}) must divide num_experts ({num}) in layer {name!r}")
        if limited is None or not 1 <= limited <= groups:
            raise ValueError(
                f"num_limited_groups ({limited}) must be set and within 1..num_expert_groups ({groups}) "
                f"in layer {name!r}"
            )


def fill_autoep_config_from_hf(config: AutoEPConfig, model_config: Any) -> None:
    """Fill what the user left unset from a Hugging Face model config, in place: `n_group` -> num_expert_groups,
    `topk_group` -> num_limited_groups, and (with routed_scaling_factor "auto") `routed_scaling_factor` ->
    route_scale."""
    if model_config is None:
        return
    if config.num_expert_groups is None:
        config.num_expert_groups = getattr(model_config, "n_group", None)
    if config.num_limited_groups is None:
        config.num_limited_groups = getattr(model_config, "topk_group", None)
    if config.routed_scaling_factor == "auto":
        scale = getattr(model_config, "routed_scaling_factor", None)
        if scale is not None:
            if isinstance(scale, bool) or not math.isfinite(float(scale)):
                raise ValueError(f"model.config.routed_scaling_factor must be a finite number, got {scale!r}")
            config.route_scale = float(scale)
