"""ds-zero: ZeRO stages 1-3 with CPU offload, usable with any torch optimizer and no engine.

`LossScaler` and `DynamicLossScaler` are re-exported from ds_ops.precision so a standalone loop needs
only this package to set up fp16 loss scaling.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ds_ops.precision import DynamicLossScaler, LossScaler
from ds_zero.__about__ import __version__
from ds_zero._checkpoint.deepspeed_files import write_deepspeed_files
from ds_zero._checkpoint.format import FORMAT_VERSION as CHECKPOINT_FORMAT_VERSION
from ds_zero._checkpoint.format import consolidate_fp32_params
from ds_zero._checkpoint.io import (
    load_zero_checkpoint,
    save_zero_checkpoint,
    zero_param_shapes,
    zero_sub_group_param_shapes,
)
from ds_zero._checkpoint.model_states import (
    frozen_fields,
    read_frozen_params,
    shared_param_names,
    stage3_fragment,
    with_shared,
)
from ds_zero._checkpoint.param_states import (
    param_states_from_partitions,
    param_states_of,
    partitions_from_param_states,
)
from ds_zero._checkpoint.partition_files import load_partition_state_dicts
from ds_zero._checkpoint.script_copy import copy_recovery_scripts, copy_zero_to_fp32_script
from ds_zero._checkpoint.universal_read import load_universal_partitions, universal_model_states_file
from ds_zero._checkpoint.universal_write import convert_to_universal
from ds_zero._construct.init import Init, partition_model
from ds_zero._construct.init_base import InsertPostInitMethodToModuleSubClasses
from ds_zero._construct.launcher_world import single_rank_group_error
from ds_zero._construct.linear import LinearFunctionForZeroStage3, zero3_linear_wrap
from ds_zero._construct.tiling import TiledLinear, TiledLinearReturnBias
from ds_zero._construct.torch_patches import torch_patches_restored
from ds_zero._memory_estimate import (
    estimate_zero2_model_states_mem_needs,
    estimate_zero2_model_states_mem_needs_all_cold,
    estimate_zero2_model_states_mem_needs_all_live,
    estimate_zero3_model_states_mem_needs,
    estimate_zero3_model_states_mem_needs_all_cold,
    estimate_zero3_model_states_mem_needs_all_live,
    model_to_params,
)
from ds_zero._nvme.files import NVMeSwapError
from ds_zero._param_access import zero_optimizer_of

# ZeRO stage 3
from ds_zero._params.gather import GatherDivergenceError, MultipleAllGatherHandles
from ds_zero._params.gathered_parameters import (
    GatheredParameters,
    register_external_parameter,
    unregister_external_parameter,
)
from ds_zero._params.param_dict import ZeroParamDict as ZeROOrderedDict
from ds_zero._params.param_dict import ensure_zero_ordered_dict
from ds_zero._params.partitioned_param import ZeroParamStatus, ZeroParamType, is_zero_param
from ds_zero._quantizer import CUDAQuantizer
from ds_zero._schedule.generation import unwrap_model_for_generation
from ds_zero._schedule.leaf_modules import (
    get_z3_leaf_modules,
    set_z3_leaf_module,
    set_z3_leaf_modules,
    set_z3_leaf_modules_by_name,
    set_z3_leaf_modules_by_suffix,
    unset_z3_leaf_modules,
    z3_leaf_module,
    z3_leaf_parameter,
)
from ds_zero._schedule.module import DeepSpeedZeRoOffload
from ds_zero._stage3.checkpoint import consolidated_16bit_state_dict
from ds_zero._stage3.optimizer import DeepSpeedZeroOptimizer_Stage3
from ds_zero._stage12.optimizer import DeepSpeedZeroOptimizer, ZeroOptimizer
from ds_zero._zenflow import ZenFlowSchedule, ZenFlowZeroOptimizer
from ds_zero.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    convert_zero_checkpoint_to_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)

if TYPE_CHECKING:  # type checkers see the lazy names' real types
    from ds_zero.config import (
        LeafModuleConfig,
        OffloadOptimizerConfig,
        OffloadParamConfig,
        WeightQuantizationConfig,
        ZenFlowConfig,
        ZeroConfig,
    )

_CONFIG_NAMES = frozenset(
    {
        "LeafModuleConfig",
        "OffloadOptimizerConfig",
        "OffloadParamConfig",
        "WeightQuantizationConfig",
        "ZenFlowConfig",
        "ZeroConfig",
    }
)


def __getattr__(name: str) -> object:
    # The config models import pydantic (~0.3 s to import); they load when first asked for.
    if name in _CONFIG_NAMES:
        return getattr(importlib.import_module("ds_zero.config"), name)
    raise AttributeError(f"module 'ds_zero' has no attribute {name!r}")


__all__ = [
    "CHECKPOINT_FORMAT_VERSION",
    "CUDAQuantizer",
    "DeepSpeedZeroOptimizer",
    "DynamicLossScaler",
    "LeafModuleConfig",
    "LossScaler",
    "OffloadOptimizerConfig",
    "OffloadParamConfig",
    "WeightQuantizationConfig",
    "ZenFlowConfig",
    "ZenFlowSchedule",
    "ZenFlowZeroOptimizer",
    "ZeroConfig",
    "ZeroOptimizer",
    "__version__",
    "consolidate_fp32_params",
    "convert_to_universal",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "copy_recovery_scripts",
    "copy_zero_to_fp32_script",
    "frozen_fields",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_partition_state_dicts",
    "load_state_dict_from_zero_checkpoint",
    "load_universal_partitions",
    "load_zero_checkpoint",
    "param_states_from_partitions",
    "param_states_of",
    "partitions_from_param_states",
    "read_frozen_params",
    "save_zero_checkpoint",
    "shared_param_names",
    "stage3_fragment",
    "universal_model_states_file",
    "with_shared",
    "write_deepspeed_files",
    "zero_optimizer_of",
    "zero_param_shapes",
    "zero_sub_group_param_shapes",
    # ZeRO stage 3
    "DeepSpeedZeRoOffload",
    "DeepSpeedZeroOptimizer_Stage3",
    "GatherDivergenceError",
    "GatheredParameters",
    "Init",
    "InsertPostInitMethodToModuleSubClasses",
    "LinearFunctionForZeroStage3",
    "MultipleAllGatherHandles",
    "NVMeSwapError",
    "TiledLinear",
    "TiledLinearReturnBias",
    "ZeROOrderedDict",
    "ZeroParamStatus",
    "ZeroParamType",
    "consolidated_16bit_state_dict",
    "ensure_zero_ordered_dict",
    "is_zero_param",
    "partition_model",
    "register_external_parameter",
    "single_rank_group_error",
    "unregister_external_parameter",
    "unwrap_model_for_generation",
    "torch_patches_restored",
    "zero3_linear_wrap",
    # ZeRO-3 leaf modules (DeepSpeed's deepspeed.utils.z3_leaf_module)
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
    # memory estimators (DeepSpeed's stage_1_and_2 / stage3 functions)
    "estimate_zero2_model_states_mem_needs",
    "estimate_zero2_model_states_mem_needs_all_cold",
    "estimate_zero2_model_states_mem_needs_all_live",
    "estimate_zero3_model_states_mem_needs",
    "estimate_zero3_model_states_mem_needs_all_cold",
    "estimate_zero3_model_states_mem_needs_all_live",
    "model_to_params",
]
