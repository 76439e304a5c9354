"""DeepSpeed's `deepspeed.autotuning.constants`: the section's key names and defaults, the default tuning spaces."""

from __future__ import annotations

from ds_launcher._autotuning.settings import AutotuningSettings
from ds_launcher._autotuning.space import STAGE_KNOBS

_DEFAULTS = {name: field.default for name, field in AutotuningSettings.model_fields.items()}

AUTOTUNING = "autotuning"
AUTOTUNING_ENABLED = "enabled"
AUTOTUNING_ENABLED_DEFAULT = _DEFAULTS["enabled"]
AUTOTUNING_FAST = "fast"
AUTOTUNING_FAST_DEFAULT = _DEFAULTS["fast"]
AUTOTUNING_RESULTS_DIR = "results_dir"
AUTOTUNING_RESULTS_DIR_DEFAULT = _DEFAULTS["results_dir"]
AUTOTUNING_EXPS_DIR = "exps_dir"
AUTOTUNING_EXPS_DIR_DEFAULT = _DEFAULTS["exps_dir"]
AUTOTUNING_OVERWRITE = "overwrite"
AUTOTUNING_OVERWRITE_DEFAULT = _DEFAULTS["overwrite"]
AUTOTUNING_START_PROFILE_STEP = "start_profile_step"
AUTOTUNING_START_PROFILE_STEP_DEFAULT = _DEFAULTS["start_profile_step"]
AUTOTUNING_END_PROFILE_STEP = "end_profile_step"
AUTOTUNING_END_PROFILE_STEP_DEFAULT = _DEFAULTS["end_profile_step"]
AUTOTUNING_METRIC_PATH = "metric_path"
AUTOTUNING_METRIC_PATH_DEFAULT = _DEFAULTS["metric_path"]
AUTOTUNING_TUNER_TYPE = "tuner_type"
AUTOTUNING_TUNER_GRIDSEARCH = "gridsearch"
AUTOTUNING_TUNER_RANDOM = "random"
AUTOTUNING_TUNER_MODELBASED = "model_based"
AUTOTUNING_TUNER_TYPE_DEFAULT = _DEFAULTS["tuner_type"]
AUTOTUNING_TUNER_EARLY_STOPPING = "tuner_early_stopping"
AUTOTUNING_TUNER_EARLY_STOPPING_DEFAULT = _DEFAULTS["tuner_early_stopping"]
AUTOTUNING_TUNER_NUM_TRIALS = "tuner_num_trials"
AUTOTUNING_TUNER_NUM_TRIALS_DEFAULT = _DEFAULTS["tuner_num_trials"]
AUTOTUNING_ARG_MAPPINGS = "arg_mappings"
AUTOTUNING_ARG_MAPPINGS_DEFAULT = _DEFAULTS["arg_mappings"]
AUTOTUNING_MAX_TRAIN_BATCH_SIZE = "max_train_batch_size"
AUTOTUNING_MAX_TRAIN_BATCH_SIZE_DEFAULT = _DEFAULTS["max_train_batch_size"]
AUTOTUNING_MIN_TRAIN_BATCH_SIZE = "min_train_batch_size"
AUTOTUNING_MIN_TRAIN_BATCH_SIZE_DEFAULT = _DEFAULTS["min_train_batch_size"]
AUTOTUNING_MAX_TRAIN_MICRO_BATCH_SIZE_PER_GPU = "max_train_micro_batch_size_per_gpu"
AUTOTUNING_MAX_TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = _DEFAULTS["max_train_micro_batch_size_per_gpu"]
AUTOTUNING_MIN_TRAIN_MICRO_BATCH_SIZE_PER_GPU = "min_train_micro_batch_size_per_gpu"
AUTOTUNING_MIN_TRAIN_MICRO_BATCH_SIZE_PER_GPU_DEFAULT = _DEFAULTS["min_train_micro_batch_size_per_gpu"]
AUTOTUNING_NUM_TUNING_MICRO_BATCH_SIZES = "num_tuning_micro_batch_sizes"
AUTOTUNING_NUM_TUNING_MICRO_BATCH_SIZES_DEFAULT = _DEFAULTS["num_tuning_micro_batch_sizes"]
AUTOTUNING_MP_SIZE = "mp_size"
AUTOTUNING_MP_SIZE_DEFAULT = _DEFAULTS["mp_size"]
AUTOTUNING_METRIC = "metric"
AUTOTUNING_METRIC_LATENCY = "latency"
AUTOTUNING_METRIC_THROUGHPUT = "throughput"
AUTOTUNING_METRIC_FLOPS = "flops"
AUTOTUNING_METRIC_DEFAULT = _DEFAULTS["metric"]
AUTOTUNING_MODEL_INFO_PATH = "model_info_path"
AUTOTUNING_MODEL_INFO_PATH_DEFAULT = _DEFAULTS["model_info_path"]
MODEL_INFO = "model_info"
MODEL_INFO_PROFILE = "profile"
MODEL_INFO_NUM_PARAMS = "num_params"
MODEL_INFO_HIDDEN_SIZE = "hidden_size"
MODEL_INFO_NUM_LAYERS = "num_layers"

#: The stages' default ZeRO tuning spaces (tried with `fast: false`).
DEFAULT_TUNING_SPACE_ZERO_0 = {"zero_optimization": {"stage": 0, **STAGE_KNOBS[0]}}
DEFAULT_TUNING_SPACE_ZERO_1 = {"zero_optimization": {"stage": 1, **STAGE_KNOBS[1]}}
DEFAULT_TUNING_SPACE_ZERO_2 = {"zero_optimization": {"stage": 2, **STAGE_KNOBS[2]}}
DEFAULT_TUNING_SPACE_ZERO_3 = {"zero_optimization": {"stage": 3, **STAGE_KNOBS[3]}}
GLOBAL_TUNING_SPACE = "global"
TUNING_MICRO_BATCH_SIZE_PREFIX = "z"
DS_CONFIG = "ds_config"
