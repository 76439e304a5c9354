"""AutoEP at initialize(): convert the model's MoE blocks to expert parallelism before anything else sees it.

The conversion (ds-parallel's `autoep`, the `parallel` extra) runs right after the process layout is known
and before the engine is assembled, so the MoE wiring that follows (`_step.moe`: expert groups, the init
broadcast, expert-data-parallel gradient reduction, ZeRO 1/2 partitions per expert group, per-expert
checkpoint files) treats the new layers as it treats DeepSpeed-MoE layers.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from torch import nn

from ds_engine._optional import require
from ds_engine._plan.dist_info import DistInfo
from ds_engine.config._expert_parallel_section import ExpertParallelConfig

__all__ = ["apply_autoep", "autoep_options"]

logger = logging.getLogger(__name__)

_OPTION_KEYS = (
    "autoep_size",
    "preset_model",
    "moe_layer_pattern",
    "expert_pattern",
    "router_pattern",
    "route_norm",
    "route_scale",
    "score_apply",
    "score_func",
    "top_k",
    "num_expert_groups",
    "num_limited_groups",
    "routed_scaling_factor",
    "expert_w1",
    "expert_w2",
    "num_experts_attr",
    "top_k_attr",
    "has_shared_experts",
    "shared_experts_pattern",
    "shared_experts_gate_pattern",
    "expert_activation",
)


def autoep_options(section: ExpertParallelConfig) -> Any:
    """ds-parallel's `AutoEPOptions` from the section (`expert_w3` only when given: null there means fused)."""
    ds_parallel = require("ds_parallel", extra="parallel", feature="AutoEP (expert_parallel.enabled)")
    kwargs = {key: getattr(section, key) for key in _OPTION_KEYS}
    if "expert_w3" in section.model_fields_set:
        kwargs["expert_w3"] = section.expert_w3
    return ds_parallel.autoep.AutoEPOptions(**kwargs)


def _check_layout(
    section: ExpertParallelConfig, dist: DistInfo, *, tp_size: int, zero_stage: int, pipeline: bool
) -> None:
    ep = section.autoep_size
    if pipeline:
        raise ValueError("expert_parallel.enabled: AutoEP converts a plain model, not a PipelineModule")
    if tp_size > 1:
        raise ValueError(
            f"expert_parallel.enabled with tensor_parallel.autotp_size={tp_size}: folding AutoEP with AutoTP is not "
            "implemented in ds; set tensor_parallel.autotp_size to 1 (or expert_parallel.enabled to false)"
        )
    if dist.sp_world_size > 1:
        raise ValueError(
            f"expert_parallel.enabled with sequence_parallel_size={dist.sp_world_size} is not implemented in ds; "
            "use one of them"
        )
    if zero_stage == 3:
        raise ValueError(
            "expert_parallel.enabled with zero_optimization.stage=3 is not implemented in ds; use ZeRO stage 0, 1 or 2"
        )
    if dist.dp_world_size % ep:
        raise ValueError(
            f"expert_parallel.autoep_size={ep} must divide the data-parallel world size {dist.dp_world_size}"
        )


def _fresh(params: Any, model: nn.Module) -> Any:
    """A list of parameters (or groups) given before conversion, with replaced ones swapped for the model's."""
    if params is None or not isinstance(params, list | tuple):
        return params  # a generator reads the converted model when the optimizer consumes it
    live = {id(p) for p in model.parameters()}

    def stale(items: Iterable[Any]) -> bool:
        return any(id(p) not in live for p in items)

    flat = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else list(params)
    if not stale(flat):
        return params
    logger.warning("AutoEP replaced parameters given in model_parameters; using the converted model's parameters")
    return [p for p in model.parameters() if p.requires_grad]


def apply_autoep(
    model: nn.Module,
    section: ExpertParallelConfig,
    dist: DistInfo,
    *,
    tp_size: int,
    zero_stage: int,
    pipeline: bool,
    model_parameters: Any = None,
) -> tuple[Any, Any]:
    """Convert `model` in place when `expert_parallel.enabled`; (the conversion report or None, model_parameters).

    Creates the expert-parallel groups of degree `autoep_size` (a collective on every rank).

    Raises:
        ValueError: a layout AutoEP does not support here, or a conversion error (names the key).
    """
    if not section.enabled:
        return None, model_parameters
    _check_layout(section, dist, tp_size=tp_size, zero_stage=zero_stage, pipeline=pipeline)
    ds_parallel = require("ds_parallel", extra="parallel", feature="AutoEP (expert_parallel.enabled)")
    options = autoep_options(section)
    ds_parallel.autoep.detect_moe_layers(model, options)  # a model AutoEP cannot convert fails before any collective
    groups = ds_parallel.moe.create_expert_groups(section.autoep_size)
    report = ds_parallel.autoep.convert_moe_model(model, options, ep_rank=groups.ep_rank, ep_group=groups.ep_group)
    return report, _fresh(model_parameters, model)
