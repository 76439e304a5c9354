"""AutoTP: automatic tensor parallelism for Hugging Face style transformers, training and inference.

`shard_model(model, tp_group=...)` replaces each block's linear layers with column-parallel
(`LinearLayer`) and row-parallel (`LinearAllreduce`) shards by DeepSpeed's rules; `full_state_dict` /
`load_full_state_dict` move whole weights in and out of a sharded model. `set_autotp_mode` chooses
what layers are built for, as `deepspeed.module_inject.layers.set_autotp_mode` does.
`extract_hf_tp_plan` reads a Hugging Face model's tensor-parallel plan; `shard_model(..., tp_plan=...)`
cuts by that plan instead of by module names (`resolve_plan` shows what it would cut), and
`shard_model(..., partition_config=AutoTPConfig...)` by DeepSpeed's regex layer specs (`resolve_specs`).
Every layer records on its parameters how it cut them, in DeepSpeed's universal-checkpoint schema
(`DS_AUTOTP_UC_META`); `collect_autotp_universal_checkpoint_info` aggregates the records into DeepSpeed's
model-level `universal_checkpoint_info`. DeepSpeed's sub-parameter, Yuan and fused-qkv layers are here
under their DeepSpeed names, and DeepSpeed's private helper names are aliases of the public ones.
`AutoTPMeta`, `get_shard_size` and `get_shard_size_list` are DeepSpeed's `tp_shard` spellings of `TPMeta`
and `shard_size(s)`.
"""

from __future__ import annotations

from ds_parallel.tensor._hf_plan import extract_hf_tp_plan
from ds_parallel.tensor._layers import (
    FusedQKVLinearLayer,
    GateUpPackLinearLayer,
    LinearAllreduce,
    LinearLayer,
    LmHeadLinearAllreduce,
    TensorParallelLayer,
)
from ds_parallel.tensor._layout import ShardLayout
from ds_parallel.tensor._mode import AutoTPMode, get_autotp_mode, is_autotp_training_mode, set_autotp_mode
from ds_parallel.tensor._model_layers import Yuan_LinearAllreduce, Yuan_LinearLayer, fused_LinearLayer
from ds_parallel.tensor._parser import (
    UNSUPPORTED_FAMILIES,
    BlockPolicy,
    block_modules,
    find_block_policies,
    model_family,
)
from ds_parallel.tensor._partition_config import (
    AutoTPConfig,
    AutoTPPresets,
    PartitionType,
    TPLayerSpec,
    merge_autotp_configs,
    model_type_of,
    partition_config_from_settings,
)
from ds_parallel.tensor._plan import (
    PLAN_STYLES,
    PlanStyle,
    ResolvedPlan,
    plan_pattern,
    plan_regex,
    plan_wildcard_regex,
    resolve_plan,
)
from ds_parallel.tensor._plan_specs import plan_to_layer_specs
from ds_parallel.tensor._regions import CopyToTPRegion, GatherFromTPRegion, ReduceFromTPRegion
from ds_parallel.tensor._replace import shard_model
from ds_parallel.tensor._shard_sizes import TPMeta, shard_size, shard_sizes
from ds_parallel.tensor._spec_plan import ResolvedSpecs, resolve_specs
from ds_parallel.tensor._state import full_state_dict, load_full_state_dict, tp_layers
from ds_parallel.tensor._subparam import SubParamLinearAllreduce, SubParamLinearLayer
from ds_parallel.tensor._tp_shard import AutoTPMeta, get_shard_size, get_shard_size_list
from ds_parallel.tensor._uc_meta import (
    DS_AUTOTP_UC_META,
    build_param_uc_conversion_meta,
    build_param_uc_restore_meta,
    collect_autotp_universal_checkpoint_info,
    param_uc_conversion_meta,
    subparam_shard_widths,
)

#: DeepSpeed's names (`deepspeed.module_inject.layers`) of the same things.
GateUpPack_LinearLayer = GateUpPackLinearLayer
_build_param_uc_conversion_meta = build_param_uc_conversion_meta
_build_param_uc_restore_meta = build_param_uc_restore_meta
_get_param_uc_conversion_meta = param_uc_conversion_meta
_subparam_shard_widths = subparam_shard_widths

__all__ = [
    "resolve_specs",
    "ResolvedSpecs",
    "partition_config_from_settings",
    "model_type_of",
    "merge_autotp_configs",
    "TPLayerSpec",
    "PartitionType",
    "AutoTPPresets",
    "AutoTPConfig",
    "DS_AUTOTP_UC_META",
    "PLAN_STYLES",
    "UNSUPPORTED_FAMILIES",
    "AutoTPMeta",
    "AutoTPMode",
    "BlockPolicy",
    "CopyToTPRegion",
    "FusedQKVLinearLayer",
    "GateUpPackLinearLayer",
    "GateUpPack_LinearLayer",
    "GatherFromTPRegion",
    "LinearAllreduce",
    "LinearLayer",
    "LmHeadLinearAllreduce",
    "PlanStyle",
    "ReduceFromTPRegion",
    "ResolvedPlan",
    "ShardLayout",
    "SubParamLinearAllreduce",
    "SubParamLinearLayer",
    "TPMeta",
    "TensorParallelLayer",
    "Yuan_LinearAllreduce",
    "Yuan_LinearLayer",
    "build_param_uc_conversion_meta",
    "build_param_uc_restore_meta",
    "collect_autotp_universal_checkpoint_info",
    "block_modules",
    "extract_hf_tp_plan",
    "find_block_policies",
    "full_state_dict",
    "fused_LinearLayer",
    "get_autotp_mode",
    "get_shard_size",
    "get_shard_size_list",
    "is_autotp_training_mode",
    "load_full_state_dict",
    "model_family",
    "param_uc_conversion_meta",
    "plan_pattern",
    "plan_regex",
    "plan_to_layer_specs",
    "plan_wildcard_regex",
    "resolve_plan",
    "set_autotp_mode",
    "shard_model",
    "shard_size",
    "shard_sizes",
    "subparam_shard_widths",
    "tp_layers",
]
