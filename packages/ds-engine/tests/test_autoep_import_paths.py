"""DeepSpeed's AutoEP import paths under ds_engine give ds-parallel's own objects, under DeepSpeed's names
(`optional_reexport`'s renames), and a `dist` that is ds-comm, the module their collectives go through."""

from __future__ import annotations

import importlib

import pytest

import ds_comm

autoep = pytest.importorskip("ds_parallel", reason="needs ds-parallel: pip install 'ds-engine[parallel]'").autoep

_SAME_NAME = {
    "moe.fused_expert_layout": ["classify_fused_gate_up_layout", "FusedExpertLayout"],
    "moe.ep_router": ["TokenChoiceTopKRouter"],
    "moe.ep_count": ["count_tokens_per_expert"],
    "moe.ep_repack": ["repack_expert_weights"],
    "moe.ep_experts": ["EXPERT_ACTIVATIONS"],
    "moe.ep_tp_dispatch": ["partition_assignments", "restore_combined", "RoutedAssignmentPayload"],
    "module_inject.auto_ep": ["AutoEP"],
    "module_inject.auto_ep_config": ["AutoEPConfig", "parse_autoep_config", "validate_autoep_config", "MoELayerSpec"],
    "module_inject.auto_ep_folding": ["build_folding_spec", "expected_folding_group_tables", "FoldingGroupHandles"],
    "module_inject.auto_ep_layer": ["AutoEPMoELayer", "combine_from_routed", "SplitPlan", "compute_split_plan"],
    "module_inject.auto_ep_preset_adapters": ["get_preset_adapter"],
    "module_inject.auto_ep_presets.registry": ["PRESET_MODELS", "unsupported_preset_for_hf_model_type"],
}
_RENAMED = {
    ("moe.ep_experts", "GroupedExperts"): "SizedGroupedExperts",
    ("module_inject.auto_ep", "_resolve_route_scale"): "resolve_route_scale",
    ("module_inject.auto_ep_preset_adapters", "AutoEPPresetAdapter"): "PresetAdapter",
    ("module_inject.auto_ep_presets.registry", "preset_name_for_hf_model_type"): "preset_for_model_type",
}


@pytest.mark.parametrize("path", sorted(_SAME_NAME))
def test_paths_hand_out_ds_parallels_objects(path: str) -> None:
    shim = importlib.import_module(f"ds_engine.{path}")
    for name in _SAME_NAME[path]:
        assert getattr(shim, name) is getattr(autoep, name), name
        assert name in shim.__all__
    with pytest.raises(AttributeError, match="has no attribute 'convert_moe_model_x'"):
        _ = shim.convert_moe_model_x


def test_deepspeed_names_map_to_ds_names() -> None:
    for (path, deepspeed_name), ds_name in _RENAMED.items():
        shim = importlib.import_module(f"ds_engine.{path}")
        assert getattr(shim, deepspeed_name) is getattr(autoep, ds_name)
        assert deepspeed_name in shim.__all__
    registry = importlib.import_module("ds_engine.module_inject.auto_ep_presets.registry")
    assert registry.preset_name_for_hf_model_type("qwen2_moe") == "qwen3_moe"


def test_dist_is_ds_comm_where_deepspeed_patches_it() -> None:
    for path in ("module_inject.auto_ep_layer", "moe.ep_tp_dispatch"):
        assert importlib.import_module(f"ds_engine.{path}").dist is ds_comm


def test_autoep_universal_is_ds_engines_own() -> None:
    offline = importlib.import_module("ds_engine._checkpoint.offline.autoep_zero12")
    shim = importlib.import_module("ds_engine.checkpoint.autoep_universal")
    assert shim.consolidate_autoep_zero12_expert_states is offline.consolidate_autoep_zero12_expert_states
    assert shim._zero12_fragment_path is offline.zero12_fragment_path
    assert shim._autoep_zero12_dp_ranks is offline.autoep_zero12_dp_ranks
