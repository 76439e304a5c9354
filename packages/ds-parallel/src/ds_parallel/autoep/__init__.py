"""AutoEP: expert parallelism for a Hugging Face MoE model without changing the model's code."""

from __future__ import annotations

from ds_parallel.autoep._autoep import AutoEP, resolve_route_scale
from ds_parallel.autoep._convert import (
    AutoEPOptions,
    ConversionReport,
    apply_overrides,
    convert_moe_model,
    detect_moe_layers,
)
from ds_parallel.autoep._experts import EXPERT_ACTIVATIONS, GroupedExperts, SizedGroupedExperts
from ds_parallel.autoep._fold import check_lanes_routed_alike, create_folding_groups, folded_expert_rows
from ds_parallel.autoep._fold_families import (
    AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE,
    AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL,
    AUTOEP_FOLDING_GRAD_REDUCE_SKIP,
    AUTOEP_FOLDING_GRAD_REDUCE_SUM,
    AUTOEP_FOLDING_PARAM_FAMILY_ATTR,
    AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM,
    AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM,
    AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM,
    autoep_folding_gradient_reduction_strategy,
    mark_autoep_folding_partial_router_parameter,
    mark_autoep_folding_router_parameter,
    mark_autoep_folding_sp_sharded_layernorm_parameter,
)
from ds_parallel.autoep._folding import (
    FoldingGroupHandles,
    FoldingGroupTables,
    ParallelFoldingSpec,
    assert_group_matches_spec,
    build_folding_spec,
    expected_folding_group_tables,
    local_folding_ranks,
    validate_folding_global,
)
from ds_parallel.autoep._layer import (
    AutoEPMoELayer,
    MoELayerSpec,
    apply_scores_before_experts_if_enabled,
    combine_from_routed,
    resolve_score_apply_mode,
)
from ds_parallel.autoep._layout import FusedExpertLayout, classify_fused_gate_up_layout
from ds_parallel.autoep._presets import (
    PRESETS,
    MoEModelPreset,
    PresetAdapter,
    get_preset_adapter,
    preset_for_model_type,
    unsupported_preset_for_hf_model_type,
)
from ds_parallel.autoep._replace import repack_expert_weights, replace_moe_block
from ds_parallel.autoep._router import TokenChoiceTopKRouter, TopKRouter
from ds_parallel.autoep._settings import (
    PRESET_MODELS,
    AutoEPConfig,
    fill_autoep_config_from_hf,
    parse_autoep_config,
    validate_autoep_config,
    validate_autoep_post_detection,
)
from ds_parallel.autoep._split_plan import (
    SplitPlan,
    compute_split_plan,
    compute_split_plan_from_expert_indices,
    count_tokens_per_expert,
)
from ds_parallel.autoep._tp_dispatch import (
    RestoreContext,
    RoutedAssignmentPayload,
    assert_tp_payload_consistent,
    assignment_ordinals_by_expert,
    dispatch_counters,
    partition_assignments,
    restore_combined,
)

__all__ = [
    "AUTOEP_FOLDING_GRAD_REDUCE_AVERAGE",
    "AUTOEP_FOLDING_GRAD_REDUCE_EXPERT_TP_CANCEL",
    "AUTOEP_FOLDING_GRAD_REDUCE_SKIP",
    "AUTOEP_FOLDING_GRAD_REDUCE_SUM",
    "AUTOEP_FOLDING_PARAM_FAMILY_ATTR",
    "AUTOEP_FOLDING_ROUTER_GATE_PARTIAL_PARAM",
    "AUTOEP_FOLDING_ROUTER_GATE_REPLICATED_PARAM",
    "AUTOEP_FOLDING_SP_SHARDED_LAYERNORM_PARAM",
    "autoep_folding_gradient_reduction_strategy",
    "mark_autoep_folding_partial_router_parameter",
    "mark_autoep_folding_router_parameter",
    "mark_autoep_folding_sp_sharded_layernorm_parameter",
    "EXPERT_ACTIVATIONS",
    "PRESETS",
    "PRESET_MODELS",
    "AutoEP",
    "AutoEPConfig",
    "AutoEPMoELayer",
    "AutoEPOptions",
    "ConversionReport",
    "FoldingGroupHandles",
    "FoldingGroupTables",
    "FusedExpertLayout",
    "GroupedExperts",
    "MoELayerSpec",
    "MoEModelPreset",
    "ParallelFoldingSpec",
    "PresetAdapter",
    "RestoreContext",
    "RoutedAssignmentPayload",
    "SizedGroupedExperts",
    "SplitPlan",
    "TokenChoiceTopKRouter",
    "TopKRouter",
    "apply_overrides",
    "apply_scores_before_experts_if_enabled",
    "assert_group_matches_spec",
    "assert_tp_payload_consistent",
    "assignment_ordinals_by_expert",
    "build_folding_spec",
    "check_lanes_routed_alike",
    "classify_fused_gate_up_layout",
    "combine_from_routed",
    "compute_split_plan",
    "compute_split_plan_from_expert_indices",
    "convert_moe_model",
    "create_folding_groups",
    "count_tokens_per_expert",
    "detect_moe_layers",
    "dispatch_counters",
    "expected_folding_group_tables",
    "fill_autoep_config_from_hf",
    "folded_expert_rows",
    "get_preset_adapter",
    "local_folding_ranks",
    "parse_autoep_config",
    "partition_assignments",
    "preset_for_model_type",
    "repack_expert_weights",
    "replace_moe_block",
    "resolve_route_scale",
    "resolve_score_apply_mode",
    "restore_combined",
    "unsupported_preset_for_hf_model_type",
    "validate_autoep_config",
    "validate_autoep_post_detection",
    "validate_folding_global",
]
