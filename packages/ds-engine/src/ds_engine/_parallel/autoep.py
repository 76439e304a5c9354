"""AutoEP at initialize(): convert the model's MoE blocks to expert parallelism before anything else sees it.

The conversion (ds-parallel's `autoep`, the `parallel` extra) runs right after the process layout is known
and before the engine is assembled, so the MoE wiring that follows (`_step.moe`: expert groups, the init
broadcast, expert-data-parallel gradient reduction, ZeRO 1/2 partitions per expert group, per-expert
checkpoint files) treats the new layers as it treats DeepSpeed-MoE layers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

from ds_engine._optional import require
from ds_engine._parallel.autoep_folding import FoldingFlags, check_folding, create_folding_groups, fold_layers
from ds_engine._parallel.autoep_zero3 import check_autoep_zero3
from ds_engine._plan.dist_info import DistInfo
from ds_engine.config._expert_parallel_section import ExpertParallelConfig

__all__ = ["apply_autoep", "autoep_options", "describe_autoep"]

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
    if dist.sp_world_size > 1:
        raise ValueError(
            f"expert_parallel.enabled with sequence_parallel_size={dist.sp_world_size} is not implemented in ds; "
            "use one of them"
        )
    if tp_size <= 1 and dist.dp_world_size % ep:  # folded layouts: check_folding
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


def _check_client_optimizer(optimizer: Any, model: nn.Module, blocks: list[tuple[str, Any]]) -> None:
    """An optimizer built before initialize() must not hold the router/expert weights AutoEP replaces."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return  # None, or a callable that receives the converted model's parameters
    replaced = set()
    for name, preset in blocks:
        block = model.get_submodule(name)
        for child in (preset.router_pattern, preset.experts_pattern):
            replaced |= {id(p) for p in getattr(block, child).parameters()}
    if any(id(p) in replaced for group in optimizer.param_groups for p in group["params"]):
        raise ValueError(
            "expert_parallel.enabled: the optimizer passed to initialize() holds the MoE routers' and experts' "
            "parameters, which AutoEP replaces; pass a callable (params -> optimizer) or use the config's "
            "optimizer section instead"
        )


def apply_autoep(
    model: nn.Module,
    section: ExpertParallelConfig,
    dist: DistInfo,
    *,
    tp_size: int,
    zero_stage: int,
    pipeline: bool,
    model_parameters: Any = None,
    client_optimizer: Any = None,
    zero_config: Any = None,
    tp_group: ProcessGroup | None = None,
    folding: FoldingFlags | None = None,
) -> tuple[Any, Any]:
    """Convert `model` in place when `expert_parallel.enabled`; (the conversion report or None, model_parameters).

    Creates the expert-parallel groups of degree `autoep_size` (a collective on every rank). At ZeRO stage 3
    `zero_config` (the `zero_optimization` section) is checked against DeepSpeed's AutoEP gate first. With
    `tp_size` > 1 (AutoTP over `tp_group`, done before) the layers are folded (`_parallel.autoep_folding`;
    `folding`: the config switches its rules read).

    Raises:
        ValueError: a layout AutoEP does not support here, or a conversion error (names the key).
    """
    if not section.enabled:
        return None, model_parameters
    _check_layout(section, dist, tp_size=tp_size, zero_stage=zero_stage, pipeline=pipeline)
    spec = check_folding(section, dist, tp_size=tp_size, zero_stage=zero_stage, flags=folding) if tp_size > 1 else None
    if zero_stage == 3:
        check_autoep_zero3(section, zero_config)
    ds_parallel = require("ds_parallel", extra="parallel", feature="AutoEP (expert_parallel.enabled)")
    if section.autoep_size == 1:
        logger.warning(
            "expert_parallel.autoep_size=1: every rank holds every expert; the MoE blocks are converted but no "
            "tokens are exchanged"
        )
    options = autoep_options(section)
    # A model AutoEP cannot convert, or an optimizer over weights it replaces, fails before any collective.
    _, preset, specs = ds_parallel.autoep.detect_moe_layers(model, options)
    _check_client_optimizer(client_optimizer, model, [(s.moe_module_name, preset) for s in specs])
    handles = None
    if spec is not None:
        assert tp_group is not None, "folded AutoEP needs the tensor-parallel group"
        handles = create_folding_groups(spec, tp_group=tp_group, dist=dist)
        ep_rank, ep_group = handles.ep_ranks.index(dist.global_rank), handles.ep_group
    elif section.autoep_size == 1 and not torch.distributed.is_initialized():  # one process: nothing to exchange
        ep_rank, ep_group = 0, None
    else:
        groups = ds_parallel.moe.create_expert_groups(section.autoep_size)
        ep_rank, ep_group = groups.ep_rank, groups.ep_group
    with _gathered_sources(model, [s.moe_module_name for s in specs]):
        report = ds_parallel.autoep.convert_moe_model(model, options, ep_rank=ep_rank, ep_group=ep_group)
    if handles is not None:
        fold_layers(model, handles, validate_routing=section.validate_folding_routing)
    return report, _fresh(model_parameters, model)


def _gathered_sources(model: nn.Module, blocks: list[str]) -> Any:
    """A context in which the MoE blocks' parameters hold their full values: a model built under `zero.Init`
    (ZeRO stage 3) has them partitioned, and the conversion copies the router and expert weights out of them
    (collective over their group; every rank converts the same blocks). A plain model: nothing to do."""
    params = [p for name in blocks for p in model.get_submodule(name).parameters() if hasattr(p, "ds_tensor")]
    if not params:
        return contextlib.nullcontext()
    ds_zero = require("ds_zero", extra="zero", feature="AutoEP on a model built under zero.Init")
    return ds_zero.GatheredParameters(params)


def _preset_lines(section: ExpertParallelConfig) -> list[str]:
    """Where the blocks are looked for, from ds-parallel's presets (a note when it is not installed)."""
    try:
        ds_parallel = require("ds_parallel", extra="parallel", feature="AutoEP (expert_parallel.enabled)")
    except ImportError as err:
        return [f"presets unavailable here: {err}"]
    presets = ds_parallel.autoep.PRESETS
    if section.preset_model is None:
        picked = ", ".join(f"{t} -> {name}" for name, p in presets.items() for t in p.hf_model_types)
        out = [f"preset: picked from model.config.model_type ({picked})"]
        if section.moe_layer_pattern is None:
            return out + ["  (another model_type: every preset is tried in turn)"]
        preset = ds_parallel.autoep.MoEModelPreset(moe_layer_pattern=section.moe_layer_pattern)
        out.append("  (another model_type: the custom preset below)")
    elif section.preset_model in presets:
        preset, out = presets[section.preset_model], [f"preset: {section.preset_model} (set)"]
    else:
        return [f"preset_model {section.preset_model!r} is not a preset; choose one of {sorted(presets)}"]
    preset = ds_parallel.autoep.apply_overrides(autoep_options(section), preset)
    w3 = "fused with the gate in expert_w1" if preset.expert_w3 is None else repr(preset.expert_w3)
    out.append(
        f"MoE blocks: modules fully matching {preset.moe_layer_pattern!r} with a router child "
        f"{preset.router_pattern!r} and an experts child {preset.experts_pattern!r} (w1 {preset.expert_w1!r}, "
        f"w2 {preset.expert_w2!r}, up {w3}) become AutoEPMoELayer; others stay as they are"
    )
    shared = (
        f"shared experts {preset.shared_experts_pattern!r}"
        + (f" gated by sigmoid({preset.shared_experts_gate_pattern!r})" if preset.shared_experts_gate_pattern else "")
        if preset.has_shared_experts
        else "no shared experts"
    )
    out.append(f"  kept dense (replicated, averaged over data parallel): the router, {shared}")
    return out


def _model_lines(section: ExpertParallelConfig, model: nn.Module) -> list[str]:
    """The blocks AutoEP would replace in `model`, and where each expert would live (detection only)."""
    ds_parallel = require("ds_parallel", extra="parallel", feature="AutoEP (expert_parallel.enabled)")
    try:
        family, _, specs = ds_parallel.autoep.detect_moe_layers(model, autoep_options(section))
    except ValueError as err:
        return [f"this model: initialize() would refuse it: {err}"]
    report = ds_parallel.autoep.ConversionReport(
        preset=family, ep_size=section.autoep_size, ep_rank=0, layers=tuple(specs)
    )
    return ["this model:", *(f"  {line}" for line in report.lines())]


def describe_autoep(section: ExpertParallelConfig, *, world_size: int, model: nn.Module | None = None) -> list[str]:
    """What initialize() would do with the model's MoE blocks (for `explain`); nothing is built or converted.

    With `model`, the blocks are detected in it and listed with their expert placement.
    """
    if not section.enabled:
        return ["off (expert_parallel.enabled is false): MoE blocks stay as the model defines them"]
    ep = section.autoep_size
    out = [
        f"autoep_size {ep}: expert-parallel rank r holds the contiguous experts [r*E/{ep}, (r+1)*E/{ep}) of each "
        "block (E: the block's expert count, which autoep_size must divide)",
    ]
    if world_size % ep == 0:
        ep_groups = [list(range(s, s + ep)) for s in range(0, world_size, ep)]
        edp_groups = [list(range(s, world_size, ep)) for s in range(ep)]
        out.append(
            f"  on {world_size} data-parallel ranks: expert-parallel groups {ep_groups} (tokens exchanged by "
            f"all-to-all), expert-data-parallel groups {edp_groups} (expert gradients summed, divided by {world_size})"
        )
    else:
        out.append(
            f"  autoep_size {ep} does not divide the data-parallel world size {world_size}: initialize() refuses it"
        )
    out += _preset_lines(section)
    top_k = section.top_k if section.top_k != "auto" else "model.config's top_k_attr (num_experts_per_tok)"
    norm = section.route_norm if section.route_norm is not None else "model.config.norm_topk_prob, else the preset's"
    scale = (
        section.routed_scaling_factor
        if section.routed_scaling_factor != "auto"
        else f"model.config.routed_scaling_factor, else route_scale {section.route_scale:g}"
    )
    groups = (
        f"{section.num_limited_groups} of {section.num_expert_groups} expert groups"
        if section.num_expert_groups is not None
        else "model.config n_group/topk_group for DeepSeek presets, else none"
    )
    out.append(
        f"routing: score_func {section.score_func}, top_k {top_k}, route_norm {norm}, scale {scale}, "
        f"score_apply {section.score_apply}, group-limited: {groups} ('auto' = the preset's)"
    )
    out.append(
        "checkpoints: experts in layer_{L}_expert_{E}_mp_rank_00_model_states.pt, one file per global expert "
        "(ZeRO 3: in the ZeRO partitions only, as DeepSpeed); they load at any autoep_size, with the ZeRO "
        "optimizer state"
    )
    if model is not None:
        out += _model_lines(section, model)
    return out
