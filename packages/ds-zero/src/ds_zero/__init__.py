"""ds-zero: ZeRO stages 1-3 with CPU offload, usable with any torch optimizer and no engine.

`LossScaler` and `DynamicLossScaler` are re-exported from ds_ops.precision so a standalone loop needs
only this package to set up fp16 loss scaling.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ds_zero.__about__ import __version__

if TYPE_CHECKING:  # type checkers see the lazy names' real types
    from ds_ops.precision import DynamicLossScaler as DynamicLossScaler
    from ds_ops.precision import LossScaler as LossScaler
    from ds_zero._checkpoint.deepspeed_files import write_deepspeed_files as write_deepspeed_files
    from ds_zero._checkpoint.format import FORMAT_VERSION as CHECKPOINT_FORMAT_VERSION
    from ds_zero._checkpoint.format import consolidate_fp32_params as consolidate_fp32_params
    from ds_zero._checkpoint.format import fp32_param_values as fp32_param_values
    from ds_zero._checkpoint.io import load_zero_checkpoint as load_zero_checkpoint
    from ds_zero._checkpoint.io import save_zero_checkpoint as save_zero_checkpoint
    from ds_zero._checkpoint.io import zero_param_shapes as zero_param_shapes
    from ds_zero._checkpoint.io import zero_sub_group_param_shapes as zero_sub_group_param_shapes
    from ds_zero._checkpoint.model_states import frozen_fields as frozen_fields
    from ds_zero._checkpoint.model_states import read_frozen_params as read_frozen_params
    from ds_zero._checkpoint.model_states import shared_param_names as shared_param_names
    from ds_zero._checkpoint.model_states import stage3_fragment as stage3_fragment
    from ds_zero._checkpoint.model_states import with_shared as with_shared
    from ds_zero._checkpoint.param_states import param_states_from_partitions as param_states_from_partitions
    from ds_zero._checkpoint.param_states import param_states_of as param_states_of
    from ds_zero._checkpoint.param_states import partitions_from_param_states as partitions_from_param_states
    from ds_zero._checkpoint.partition_files import load_partition_state_dicts as load_partition_state_dicts
    from ds_zero._checkpoint.script_copy import copy_recovery_scripts as copy_recovery_scripts
    from ds_zero._checkpoint.script_copy import copy_zero_to_fp32_script as copy_zero_to_fp32_script
    from ds_zero._checkpoint.universal_read import load_universal_partitions as load_universal_partitions
    from ds_zero._checkpoint.universal_read import universal_model_states_file as universal_model_states_file
    from ds_zero._checkpoint.universal_write import convert_to_universal as convert_to_universal
    from ds_zero._construct.init import Init as Init
    from ds_zero._construct.init import partition_model as partition_model
    from ds_zero._construct.init_base import (
        InsertPostInitMethodToModuleSubClasses as InsertPostInitMethodToModuleSubClasses,
    )
    from ds_zero._construct.launcher_world import single_rank_group_error as single_rank_group_error
    from ds_zero._construct.linear import LinearFunctionForZeroStage3 as LinearFunctionForZeroStage3
    from ds_zero._construct.linear import zero3_linear_wrap as zero3_linear_wrap
    from ds_zero._construct.tiling import TiledLinear as TiledLinear
    from ds_zero._construct.tiling import TiledLinearReturnBias as TiledLinearReturnBias
    from ds_zero._construct.torch_patches import torch_patches_restored as torch_patches_restored
    from ds_zero._memory_estimate import estimate_zero2_model_states_mem_needs as estimate_zero2_model_states_mem_needs
    from ds_zero._memory_estimate import (
        estimate_zero2_model_states_mem_needs_all_cold as estimate_zero2_model_states_mem_needs_all_cold,
    )
    from ds_zero._memory_estimate import (
        estimate_zero2_model_states_mem_needs_all_live as estimate_zero2_model_states_mem_needs_all_live,
    )
    from ds_zero._memory_estimate import estimate_zero3_model_states_mem_needs as estimate_zero3_model_states_mem_needs
    from ds_zero._memory_estimate import (
        estimate_zero3_model_states_mem_needs_all_cold as estimate_zero3_model_states_mem_needs_all_cold,
    )
    from ds_zero._memory_estimate import (
        estimate_zero3_model_states_mem_needs_all_live as estimate_zero3_model_states_mem_needs_all_live,
    )
    from ds_zero._memory_estimate import model_to_params as model_to_params
    from ds_zero._nvme.files import NVMeSwapError as NVMeSwapError
    from ds_zero._param_access import zero_optimizer_of as zero_optimizer_of
    from ds_zero._params.gather import GatherDivergenceError as GatherDivergenceError
    from ds_zero._params.gather import MultipleAllGatherHandles as MultipleAllGatherHandles
    from ds_zero._params.gathered_parameters import GatheredParameters as GatheredParameters
    from ds_zero._params.gathered_parameters import register_external_parameter as register_external_parameter
    from ds_zero._params.gathered_parameters import unregister_external_parameter as unregister_external_parameter
    from ds_zero._params.param_dict import ZeroParamDict as ZeROOrderedDict
    from ds_zero._params.param_dict import ensure_zero_ordered_dict as ensure_zero_ordered_dict
    from ds_zero._params.partitioned_param import ZeroParamStatus as ZeroParamStatus
    from ds_zero._params.partitioned_param import ZeroParamType as ZeroParamType
    from ds_zero._params.partitioned_param import is_zero_param as is_zero_param
    from ds_zero._quantizer import CUDAQuantizer as CUDAQuantizer
    from ds_zero._schedule.generation import unwrap_model_for_generation as unwrap_model_for_generation
    from ds_zero._schedule.leaf_modules import get_z3_leaf_modules as get_z3_leaf_modules
    from ds_zero._schedule.leaf_modules import set_z3_leaf_module as set_z3_leaf_module
    from ds_zero._schedule.leaf_modules import set_z3_leaf_modules as set_z3_leaf_modules
    from ds_zero._schedule.leaf_modules import set_z3_leaf_modules_by_name as set_z3_leaf_modules_by_name
    from ds_zero._schedule.leaf_modules import set_z3_leaf_modules_by_suffix as set_z3_leaf_modules_by_suffix
    from ds_zero._schedule.leaf_modules import unset_z3_leaf_modules as unset_z3_leaf_modules
    from ds_zero._schedule.leaf_modules import z3_leaf_module as z3_leaf_module
    from ds_zero._schedule.leaf_modules import z3_leaf_parameter as z3_leaf_parameter
    from ds_zero._schedule.module import DeepSpeedZeRoOffload as DeepSpeedZeRoOffload
    from ds_zero._stage3.checkpoint import consolidated_16bit_state_dict as consolidated_16bit_state_dict
    from ds_zero._stage3.optimizer import DeepSpeedZeroOptimizer_Stage3 as DeepSpeedZeroOptimizer_Stage3
    from ds_zero._stage12.optimizer import DeepSpeedZeroOptimizer as DeepSpeedZeroOptimizer
    from ds_zero._stage12.optimizer import ZeroOptimizer as ZeroOptimizer
    from ds_zero._zenflow import ZenFlowSchedule as ZenFlowSchedule
    from ds_zero._zenflow import ZenFlowZeroOptimizer as ZenFlowZeroOptimizer
    from ds_zero._zenflow import ZenFlowZeroOptimizer_Stage3 as ZenFlowZeroOptimizer_Stage3
    from ds_zero.config import (
        LeafModuleConfig,
        OffloadOptimizerConfig,
        OffloadParamConfig,
        WeightQuantizationConfig,
        ZenFlowConfig,
        ZeroConfig,
    )
    from ds_zero.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict as convert_zero_checkpoint_to_fp32_state_dict,
    )
    from ds_zero.zero_to_fp32 import convert_zero_checkpoint_to_state_dict as convert_zero_checkpoint_to_state_dict
    from ds_zero.zero_to_fp32 import (
        get_fp32_state_dict_from_zero_checkpoint as get_fp32_state_dict_from_zero_checkpoint,
    )
    from ds_zero.zero_to_fp32 import load_state_dict_from_zero_checkpoint as load_state_dict_from_zero_checkpoint

#: Every public name, served from the module that defines it on first use (then cached here): importing the
#: package costs almost nothing beyond torch; the stages, checkpoint tools, ops and config models (pydantic)
#: load when a name that needs them is first touched. Keys are names, values `(module, attribute)`.
_LAZY_NAMES: dict[str, tuple[str, str]] = {
    "DynamicLossScaler": ("ds_ops.precision", "DynamicLossScaler"),
    "LossScaler": ("ds_ops.precision", "LossScaler"),
    "write_deepspeed_files": ("ds_zero._checkpoint.deepspeed_files", "write_deepspeed_files"),
    "CHECKPOINT_FORMAT_VERSION": ("ds_zero._checkpoint.format", "FORMAT_VERSION"),
    "consolidate_fp32_params": ("ds_zero._checkpoint.format", "consolidate_fp32_params"),
    "fp32_param_values": ("ds_zero._checkpoint.format", "fp32_param_values"),
    "load_zero_checkpoint": ("ds_zero._checkpoint.io", "load_zero_checkpoint"),
    "save_zero_checkpoint": ("ds_zero._checkpoint.io", "save_zero_checkpoint"),
    "zero_param_shapes": ("ds_zero._checkpoint.io", "zero_param_shapes"),
    "zero_sub_group_param_shapes": ("ds_zero._checkpoint.io", "zero_sub_group_param_shapes"),
    "frozen_fields": ("ds_zero._checkpoint.model_states", "frozen_fields"),
    "read_frozen_params": ("ds_zero._checkpoint.model_states", "read_frozen_params"),
    "shared_param_names": ("ds_zero._checkpoint.model_states", "shared_param_names"),
    "stage3_fragment": ("ds_zero._checkpoint.model_states", "stage3_fragment"),
    "with_shared": ("ds_zero._checkpoint.model_states", "with_shared"),
    "param_states_from_partitions": ("ds_zero._checkpoint.param_states", "param_states_from_partitions"),
    "param_states_of": ("ds_zero._checkpoint.param_states", "param_states_of"),
    "partitions_from_param_states": ("ds_zero._checkpoint.param_states", "partitions_from_param_states"),
    "load_partition_state_dicts": ("ds_zero._checkpoint.partition_files", "load_partition_state_dicts"),
    "copy_recovery_scripts": ("ds_zero._checkpoint.script_copy", "copy_recovery_scripts"),
    "copy_zero_to_fp32_script": ("ds_zero._checkpoint.script_copy", "copy_zero_to_fp32_script"),
    "load_universal_partitions": ("ds_zero._checkpoint.universal_read", "load_universal_partitions"),
    "universal_model_states_file": ("ds_zero._checkpoint.universal_read", "universal_model_states_file"),
    "convert_to_universal": ("ds_zero._checkpoint.universal_write", "convert_to_universal"),
    "Init": ("ds_zero._construct.init", "Init"),
    "partition_model": ("ds_zero._construct.init", "partition_model"),
    "InsertPostInitMethodToModuleSubClasses": (
        "ds_zero._construct.init_base",
        "InsertPostInitMethodToModuleSubClasses",
    ),
    "single_rank_group_error": ("ds_zero._construct.launcher_world", "single_rank_group_error"),
    "LinearFunctionForZeroStage3": ("ds_zero._construct.linear", "LinearFunctionForZeroStage3"),
    "zero3_linear_wrap": ("ds_zero._construct.linear", "zero3_linear_wrap"),
    "TiledLinear": ("ds_zero._construct.tiling", "TiledLinear"),
    "TiledLinearReturnBias": ("ds_zero._construct.tiling", "TiledLinearReturnBias"),
    "torch_patches_restored": ("ds_zero._construct.torch_patches", "torch_patches_restored"),
    "estimate_zero2_model_states_mem_needs": ("ds_zero._memory_estimate", "estimate_zero2_model_states_mem_needs"),
    "estimate_zero2_model_states_mem_needs_all_cold": (
        "ds_zero._memory_estimate",
        "estimate_zero2_model_states_mem_needs_all_cold",
    ),
    "estimate_zero2_model_states_mem_needs_all_live": (
        "ds_zero._memory_estimate",
        "estimate_zero2_model_states_mem_needs_all_live",
    ),
    "estimate_zero3_model_states_mem_needs": ("ds_zero._memory_estimate", "estimate_zero3_model_states_mem_needs"),
    "estimate_zero3_model_states_mem_needs_all_cold": (
        "ds_zero._memory_estimate",
        "estimate_zero3_model_states_mem_needs_all_cold",
    ),
    "estimate_zero3_model_states_mem_needs_all_live": (
        "ds_zero._memory_estimate",
        "estimate_zero3_model_states_mem_needs_all_live",
    ),
    "model_to_params": ("ds_zero._memory_estimate", "model_to_params"),
    "NVMeSwapError": ("ds_zero._nvme.files", "NVMeSwapError"),
    "zero_optimizer_of": ("ds_zero._param_access", "zero_optimizer_of"),
    "GatherDivergenceError": ("ds_zero._params.gather", "GatherDivergenceError"),
    "MultipleAllGatherHandles": ("ds_zero._params.gather", "MultipleAllGatherHandles"),
    "GatheredParameters": ("ds_zero._params.gathered_parameters", "GatheredParameters"),
    "register_external_parameter": ("ds_zero._params.gathered_parameters", "register_external_parameter"),
    "unregister_external_parameter": ("ds_zero._params.gathered_parameters", "unregister_external_parameter"),
    "ZeROOrderedDict": ("ds_zero._params.param_dict", "ZeroParamDict"),
    "ensure_zero_ordered_dict": ("ds_zero._params.param_dict", "ensure_zero_ordered_dict"),
    "ZeroParamStatus": ("ds_zero._params.partitioned_param", "ZeroParamStatus"),
    "ZeroParamType": ("ds_zero._params.partitioned_param", "ZeroParamType"),
    "is_zero_param": ("ds_zero._params.partitioned_param", "is_zero_param"),
    "CUDAQuantizer": ("ds_zero._quantizer", "CUDAQuantizer"),
    "unwrap_model_for_generation": ("ds_zero._schedule.generation", "unwrap_model_for_generation"),
    "get_z3_leaf_modules": ("ds_zero._schedule.leaf_modules", "get_z3_leaf_modules"),
    "set_z3_leaf_module": ("ds_zero._schedule.leaf_modules", "set_z3_leaf_module"),
    "set_z3_leaf_modules": ("ds_zero._schedule.leaf_modules", "set_z3_leaf_modules"),
    "set_z3_leaf_modules_by_name": ("ds_zero._schedule.leaf_modules", "set_z3_leaf_modules_by_name"),
    "set_z3_leaf_modules_by_suffix": ("ds_zero._schedule.leaf_modules", "set_z3_leaf_modules_by_suffix"),
    "unset_z3_leaf_modules": ("ds_zero._schedule.leaf_modules", "unset_z3_leaf_modules"),
    "z3_leaf_module": ("ds_zero._schedule.leaf_modules", "z3_leaf_module"),
    "z3_leaf_parameter": ("ds_zero._schedule.leaf_modules", "z3_leaf_parameter"),
    "DeepSpeedZeRoOffload": ("ds_zero._schedule.module", "DeepSpeedZeRoOffload"),
    "consolidated_16bit_state_dict": ("ds_zero._stage3.checkpoint", "consolidated_16bit_state_dict"),
    "DeepSpeedZeroOptimizer_Stage3": ("ds_zero._stage3.optimizer", "DeepSpeedZeroOptimizer_Stage3"),
    "DeepSpeedZeroOptimizer": ("ds_zero._stage12.optimizer", "DeepSpeedZeroOptimizer"),
    "ZeroOptimizer": ("ds_zero._stage12.optimizer", "ZeroOptimizer"),
    "convert_zero_checkpoint_to_fp32_state_dict": (
        "ds_zero.zero_to_fp32",
        "convert_zero_checkpoint_to_fp32_state_dict",
    ),
    "convert_zero_checkpoint_to_state_dict": ("ds_zero.zero_to_fp32", "convert_zero_checkpoint_to_state_dict"),
    "get_fp32_state_dict_from_zero_checkpoint": ("ds_zero.zero_to_fp32", "get_fp32_state_dict_from_zero_checkpoint"),
    "load_state_dict_from_zero_checkpoint": ("ds_zero.zero_to_fp32", "load_state_dict_from_zero_checkpoint"),
    # The config models import pydantic (~0.3 s to import).
    "LeafModuleConfig": ("ds_zero.config", "LeafModuleConfig"),
    "OffloadOptimizerConfig": ("ds_zero.config", "OffloadOptimizerConfig"),
    "OffloadParamConfig": ("ds_zero.config", "OffloadParamConfig"),
    "WeightQuantizationConfig": ("ds_zero.config", "WeightQuantizationConfig"),
    "ZenFlowConfig": ("ds_zero.config", "ZenFlowConfig"),
    "ZenFlowSchedule": ("ds_zero._zenflow", "ZenFlowSchedule"),
    "ZenFlowZeroOptimizer": ("ds_zero._zenflow", "ZenFlowZeroOptimizer"),
    "ZenFlowZeroOptimizer_Stage3": ("ds_zero._zenflow", "ZenFlowZeroOptimizer_Stage3"),
    "ZeroConfig": ("ds_zero.config", "ZeroConfig"),
}


def __getattr__(name: str) -> object:
    if name not in _LAZY_NAMES:
        raise AttributeError(f"module 'ds_zero' has no attribute {name!r}")
    module, attribute = _LAZY_NAMES[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_NAMES})


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
    "ZenFlowZeroOptimizer_Stage3",
    "ZeroConfig",
    "ZeroOptimizer",
    "__version__",
    "consolidate_fp32_params",
    "convert_to_universal",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "copy_recovery_scripts",
    "copy_zero_to_fp32_script",
    "fp32_param_values",
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
