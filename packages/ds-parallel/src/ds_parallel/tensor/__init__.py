"""AutoTP: automatic tensor parallelism for Hugging Face style transformers, training and inference.

`shard_model(model, tp_group=...)` replaces each block's linear layers with column-parallel
(`LinearLayer`) and row-parallel (`LinearAllreduce`) shards by DeepSpeed's rules; `full_state_dict` /
`load_full_state_dict` move whole weights in and out of a sharded model. `set_autotp_mode` chooses
what layers are built for, as `deepspeed.module_inject.layers.set_autotp_mode` does.
`extract_hf_tp_plan` reads a Hugging Face model's tensor-parallel plan; `shard_model(..., tp_plan=...)`
cuts by that plan instead of by module names (`resolve_plan` shows what it would cut).
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
from ds_parallel.tensor._parser import (
    UNSUPPORTED_FAMILIES,
    BlockPolicy,
    block_modules,
    find_block_policies,
    model_family,
)
from ds_parallel.tensor._plan import PLAN_STYLES, PlanStyle, ResolvedPlan, plan_pattern, resolve_plan
from ds_parallel.tensor._regions import CopyToTPRegion, GatherFromTPRegion, ReduceFromTPRegion
from ds_parallel.tensor._replace import shard_model
from ds_parallel.tensor._shard_sizes import TPMeta, shard_size, shard_sizes
from ds_parallel.tensor._state import full_state_dict, load_full_state_dict, tp_layers

__all__ = [
    "PLAN_STYLES",
    "UNSUPPORTED_FAMILIES",
    "AutoTPMode",
    "BlockPolicy",
    "CopyToTPRegion",
    "FusedQKVLinearLayer",
    "GateUpPackLinearLayer",
    "GatherFromTPRegion",
    "LinearAllreduce",
    "LinearLayer",
    "LmHeadLinearAllreduce",
    "PlanStyle",
    "ReduceFromTPRegion",
    "ResolvedPlan",
    "ShardLayout",
    "TPMeta",
    "TensorParallelLayer",
    "block_modules",
    "extract_hf_tp_plan",
    "find_block_policies",
    "full_state_dict",
    "get_autotp_mode",
    "is_autotp_training_mode",
    "load_full_state_dict",
    "model_family",
    "plan_pattern",
    "resolve_plan",
    "set_autotp_mode",
    "shard_model",
    "shard_size",
    "shard_sizes",
    "tp_layers",
]
