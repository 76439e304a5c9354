"""The `data_efficiency` section as DeepSpeed's nested dict, and DeepSpeed's readers of its parts.

DeepSpeed hands this dict around (`engine.data_efficiency_config()`, the data sampler's config, the
random-LTD scheduler's config), so ds builds the same one from the user's config: each sub-switch
(`enabled`) is read where it is written and defaults to false; a sub-section's other settings are copied
in only when it is on (`curriculum_learning`, `random_ltd`), or always with defaults filled in
(`data_sampling`'s own keys, `dynamic_batching`); `random_ltd` always carries
`layer_token_lr_schedule.enabled`. Key checks happen before, in `config/` (`validate_section`); these
functions only shape.

Each `get_*` takes the mapping one level above the part it reads (DeepSpeed's signatures:
`get_data_sampling(data_efficiency_dict)`, `get_random_ltd(data_routing_dict)`, ...).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from ds_engine._data import keys as k

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

Dict = dict[str, Any]


def _read(parent: Mapping[str, Any], section: str, key: str, default: Any) -> Any:
    """`parent[section][key]`, or `default` when either level is absent."""
    sub = parent.get(section)
    return sub.get(key, default) if isinstance(sub, Mapping) else default


def _params_without_switch(parent: Mapping[str, Any], section: str) -> Dict:
    """A shallow copy of `parent[section]` without its `enabled` key (empty when absent)."""
    params = dict(parent.get(section) or {})
    params.pop("enabled", None)
    return params


# -- the whole section ------------------------------------------------------------------------------
def get_data_efficiency_config(param_dict: Mapping[str, Any]) -> Dict:
    """DeepSpeed's `data_efficiency` dict for a whole ds_config (`param_dict`)."""
    section = param_dict.get(k.DATA_EFFICIENCY) or {}
    return {
        k.DATA_EFFICIENCY_ENABLED: get_data_efficiency_enabled(param_dict),
        k.DATA_EFFICIENCY_SEED: get_data_efficiency_seed(param_dict),
        k.DATA_SAMPLING: get_data_sampling(section),
        k.DATA_ROUTING: get_data_routing(section),
    }


def get_data_efficiency_enabled(param_dict: Mapping[str, Any]) -> bool:
    return _read(param_dict, k.DATA_EFFICIENCY, k.DATA_EFFICIENCY_ENABLED, k.DATA_EFFICIENCY_ENABLED_DEFAULT)


def get_data_efficiency_seed(param_dict: Mapping[str, Any]) -> int:
    return _read(param_dict, k.DATA_EFFICIENCY, k.DATA_EFFICIENCY_SEED, k.DATA_EFFICIENCY_SEED_DEFAULT)


# -- data_sampling ----------------------------------------------------------------------------------
def get_data_sampling(param_dict: Mapping[str, Any]) -> Dict:
    """`data_sampling` (from the `data_efficiency` dict): the user's keys, the four scalars with defaults, and
    the `curriculum_learning` and `dynamic_batching` dicts."""
    sub = param_dict.get(k.DATA_SAMPLING) or {}
    out = copy.copy(dict(sub))
    out[k.DATA_SAMPLING_ENABLED] = get_data_sampling_enabled(param_dict)
    out[k.DATA_SAMPLING_NUM_EPOCHS] = get_data_sampling_num_epochs(param_dict)
    out[k.DATA_SAMPLING_NUM_WORKERS] = get_data_sampling_num_workers(param_dict)
    out[k.DATA_SAMPLING_PIN_MEMORY] = get_data_sampling_pin_memory(param_dict)
    out[k.CURRICULUM_LEARNING] = get_curriculum_learning(sub)
    out[k.DYNAMIC_BATCHING] = get_dynamic_batching(sub)
    return out


def get_data_sampling_enabled(param_dict: Mapping[str, Any]) -> bool:
    return _read(param_dict, k.DATA_SAMPLING, k.DATA_SAMPLING_ENABLED, k.DATA_SAMPLING_ENABLED_DEFAULT)


def get_data_sampling_num_epochs(param_dict: Mapping[str, Any]) -> int:
    return _read(param_dict, k.DATA_SAMPLING, k.DATA_SAMPLING_NUM_EPOCHS, k.DATA_SAMPLING_NUM_EPOCHS_DEFAULT)


def get_data_sampling_num_workers(param_dict: Mapping[str, Any]) -> int:
    return _read(param_dict, k.DATA_SAMPLING, k.DATA_SAMPLING_NUM_WORKERS, k.DATA_SAMPLING_NUM_WORKERS_DEFAULT)


def get_data_sampling_pin_memory(param_dict: Mapping[str, Any]) -> bool:
    return _read(param_dict, k.DATA_SAMPLING, k.DATA_SAMPLING_PIN_MEMORY, k.DATA_SAMPLING_PIN_MEMORY_DEFAULT)


def get_curriculum_learning(param_dict: Mapping[str, Any]) -> Dict:
    """`curriculum_learning` (from the `data_sampling` dict): `{enabled}`, plus its settings when enabled.

    Raises:
        ValueError: enabled without `curriculum_metrics`.
    """
    enabled = get_curriculum_learning_enabled(param_dict)
    out: Dict = {k.CURRICULUM_LEARNING_ENABLED: enabled}
    if enabled:
        if k.CURRICULUM_LEARNING_METRICS not in (param_dict.get(k.CURRICULUM_LEARNING) or {}):
            raise ValueError(
                "data_efficiency.data_sampling.curriculum_learning.curriculum_metrics is required when curriculum "
                "learning is enabled"
            )
        out.update(get_curriculum_learning_params(param_dict))
    return out


def get_curriculum_learning_enabled(param_dict: Mapping[str, Any]) -> bool:
    return _read(
        param_dict, k.CURRICULUM_LEARNING, k.CURRICULUM_LEARNING_ENABLED, k.CURRICULUM_LEARNING_ENABLED_DEFAULT
    )


def get_curriculum_learning_params(param_dict: Mapping[str, Any]) -> Dict:
    return _params_without_switch(param_dict, k.CURRICULUM_LEARNING)


def get_dynamic_batching(param_dict: Mapping[str, Any]) -> Dict:
    """`dynamic_batching` (from the `data_sampling` dict): the user's keys with defaults and types applied.

    Raises:
        ValueError: enabled without `max_tokens`.
    """
    out = dict(param_dict.get(k.DYNAMIC_BATCHING) or {})
    out[k.DYNAMIC_BATCHING_ENABLED] = bool(out.get(k.DYNAMIC_BATCHING_ENABLED, k.DYNAMIC_BATCHING_ENABLED_DEFAULT))
    out[k.DYNAMIC_BATCHING_LR_SCALING_METHOD] = str(
        out.get(k.DYNAMIC_BATCHING_LR_SCALING_METHOD, k.DYNAMIC_BATCHING_LR_SCALING_METHOD_DEFAULT)
    )
    out[k.DYNAMIC_BATCHING_MIN_BATCH_SIZE] = int(
        out.get(k.DYNAMIC_BATCHING_MIN_BATCH_SIZE, k.DYNAMIC_BATCHING_MIN_BATCH_SIZE_DEFAULT)
    )
    if k.DYNAMIC_BATCHING_MAX_BATCH_SIZE in out:
        out[k.DYNAMIC_BATCHING_MAX_BATCH_SIZE] = int(out[k.DYNAMIC_BATCHING_MAX_BATCH_SIZE])
    else:
        out[k.DYNAMIC_BATCHING_MAX_BATCH_SIZE] = k.DYNAMIC_BATCHING_MAX_BATCH_SIZE_DEFAULT
    out[k.DYNAMIC_BATCHING_SEQUENCE_PICKING_ORDER] = str(
        out.get(k.DYNAMIC_BATCHING_SEQUENCE_PICKING_ORDER, k.DYNAMIC_BATCHING_SEQUENCE_PICKING_ORDER_DEFAULT)
    )
    if out[k.DYNAMIC_BATCHING_ENABLED]:
        if k.DYNAMIC_BATCHING_MAX_TOKENS not in out:
            raise ValueError(
                "data_efficiency.data_sampling.dynamic_batching.max_tokens is required when dynamic batching is enabled"
            )
        out[k.DYNAMIC_BATCHING_MAX_TOKENS] = int(out[k.DYNAMIC_BATCHING_MAX_TOKENS])
    out[k.DYNAMIC_BATCHING_VERBOSE] = bool(out.get(k.DYNAMIC_BATCHING_VERBOSE, False))
    return out


# -- data_routing -----------------------------------------------------------------------------------
def get_data_routing(param_dict: Mapping[str, Any]) -> Dict:
    """`data_routing` (from the `data_efficiency` dict): `{enabled, random_ltd}`."""
    return {
        k.DATA_ROUTING_ENABLED: get_data_routing_enabled(param_dict),
        k.RANDOM_LTD: get_random_ltd(param_dict.get(k.DATA_ROUTING) or {}),
    }


def get_data_routing_enabled(param_dict: Mapping[str, Any]) -> bool:
    return _read(param_dict, k.DATA_ROUTING, k.DATA_ROUTING_ENABLED, k.DATA_ROUTING_ENABLED_DEFAULT)


def get_random_ltd(param_dict: Mapping[str, Any]) -> Dict:
    """`random_ltd` (from the `data_routing` dict): `{enabled, layer_token_lr_schedule: {enabled: false}}`, with
    every setting of the section copied over it when enabled."""
    out: Dict = {
        k.RANDOM_LTD_ENABLED: k.RANDOM_LTD_ENABLED_DEFAULT,
        k.RANDOM_LTD_LAYER_TOKEN_LR_SCHEDULE: {
            k.RANDOM_LTD_LAYER_TOKEN_LR_ENABLED: k.RANDOM_LTD_LAYER_TOKEN_LR_ENABLED_DEFAULT
        },
    }
    if get_random_ltd_enabled(param_dict):
        out[k.RANDOM_LTD_ENABLED] = True
        out.update(get_random_ltd_params(param_dict))
    return out


def get_random_ltd_enabled(param_dict: Mapping[str, Any]) -> bool:
    return _read(param_dict, k.RANDOM_LTD, k.RANDOM_LTD_ENABLED, k.RANDOM_LTD_ENABLED_DEFAULT)


def get_random_ltd_params(param_dict: Mapping[str, Any]) -> Dict:
    return _params_without_switch(param_dict, k.RANDOM_LTD)
