"""`deepspeed.runtime.data_pipeline.config`: the `data_efficiency` section as DeepSpeed's nested dict."""

from __future__ import annotations

from ds_engine._data.section import (
    get_curriculum_learning,
    get_curriculum_learning_enabled,
    get_curriculum_learning_params,
    get_data_efficiency_config,
    get_data_efficiency_enabled,
    get_data_efficiency_seed,
    get_data_routing,
    get_data_routing_enabled,
    get_data_sampling,
    get_data_sampling_enabled,
    get_data_sampling_num_epochs,
    get_data_sampling_num_workers,
    get_data_sampling_pin_memory,
    get_dynamic_batching,
    get_random_ltd,
    get_random_ltd_enabled,
    get_random_ltd_params,
)

__all__ = [
    "get_curriculum_learning",
    "get_curriculum_learning_enabled",
    "get_curriculum_learning_params",
    "get_data_efficiency_config",
    "get_data_efficiency_enabled",
    "get_data_efficiency_seed",
    "get_data_routing",
    "get_data_routing_enabled",
    "get_data_sampling",
    "get_data_sampling_enabled",
    "get_data_sampling_num_epochs",
    "get_data_sampling_num_workers",
    "get_data_sampling_pin_memory",
    "get_dynamic_batching",
    "get_random_ltd",
    "get_random_ltd_enabled",
    "get_random_ltd_params",
]
