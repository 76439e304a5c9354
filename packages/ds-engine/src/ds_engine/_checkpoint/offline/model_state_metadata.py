"""What an offline reader keeps of each `mp_rank_XX_model_states.pt`: a small summary, not the tensors.

A model-states file can hold a whole model (`module`), so `DeepSpeedCheckpoint` loads each one once,
keeps `summarize_model_state`'s few keys, and drops the rest. The summary has DeepSpeed's shape (its
`model_state_metadata` entries are `(path, summary)` pairs, which its converter consumes):

- `checkpoint_parallel_dimensions`: `{pp_degree, tp_degree}` as recorded, or None;
- `param_shapes`: one `{name: shape}` dict over all parameter groups, or None;
- `ds_autoep_layers`: the AutoEP layer entries (legacy `autoep_layers` too), reduced to the fields a
  conversion reads, or None;
- `ds_config`: `{use_data_before_expert_parallelism: bool}`.

A value of the wrong type is kept as its type's name (`"str"`), so a consumer can name the fault
without the file. `aggregate_autoep_zero12_metadata` is that consumer for a ZeRO-1/2 universal
conversion: it validates the summaries and combines them across files.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ds_engine._checkpoint.constants import (
    AUTOEP_EXPERT_KEY_PREFIX,
    AUTOEP_LAYERS_KEY,
    AUTOEP_LAYERS_KEY_LEGACY,
    AUTOEP_ZERO12_REQUIRED_FIELDS,
    CHECKPOINT_PARALLEL_DIMS,
    CHECKPOINT_PP_DEGREE,
    CHECKPOINT_TP_DEGREE,
    PARAM_SHAPES,
)

__all__ = [
    "DS_CONFIG_KEY",
    "USE_DATA_BEFORE_EXPERT_PARALLELISM",
    "aggregate_autoep_zero12_metadata",
    "summarize_model_state",
]

DS_CONFIG_KEY = "ds_config"
USE_DATA_BEFORE_EXPERT_PARALLELISM = "use_data_before_expert_parallelism"
_AUTOEP_FIELDS = ("moe_layer_id", "module_path", *AUTOEP_ZERO12_REQUIRED_FIELDS)


def _type_name(value: Any) -> str:
    return type(value).__name__


def _parallel_dimensions(state: dict[str, Any]) -> Any:
    dims = state.get(CHECKPOINT_PARALLEL_DIMS)
    if dims is None or not isinstance(dims, dict):
        return dims if dims is None else _type_name(dims)
    return {key: dims.get(key) for key in (CHECKPOINT_PP_DEGREE, CHECKPOINT_TP_DEGREE)}


def _param_shapes(state: dict[str, Any]) -> Any:
    groups = state.get(PARAM_SHAPES)
    if groups is None:
        return None
    if not isinstance(groups, (list, tuple)) or not all(isinstance(g, dict) for g in groups):
        return _type_name(groups)
    return {name: shape for group in groups for name, shape in group.items()}


def _autoep_layers(state: dict[str, Any]) -> Any:
    layers = state.get(AUTOEP_LAYERS_KEY)
    if layers is None:
        layers = state.get(AUTOEP_LAYERS_KEY_LEGACY)
    if layers is None or not isinstance(layers, list):
        return layers if layers is None else _type_name(layers)
    return [
        {k: entry[k] for k in _AUTOEP_FIELDS if k in entry} if isinstance(entry, dict) else _type_name(entry)
        for entry in layers
    ]


def _ds_config(state: dict[str, Any]) -> Any:
    config = state.get(DS_CONFIG_KEY, {})
    if not isinstance(config, dict):
        return _type_name(config)
    ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
    return {USE_DATA_BEFORE_EXPERT_PARALLELISM: ordering if isinstance(ordering, bool) else _type_name(ordering)}


def summarize_model_state(state: dict[str, Any]) -> dict[str, Any]:
    """The summary of one loaded model-states dict (see the module note)."""
    return {
        CHECKPOINT_PARALLEL_DIMS: _parallel_dimensions(state),
        PARAM_SHAPES: _param_shapes(state),
        AUTOEP_LAYERS_KEY: _autoep_layers(state),
        DS_CONFIG_KEY: _ds_config(state),
    }


def aggregate_autoep_zero12_metadata(
    model_state_metadata: Sequence[tuple[str, dict[str, Any]]],
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, bool]:
    """(each file's `{name: shape}`, the AutoEP layers by expert prefix or None, the expert-parallel ordering).

    The AutoEP layers of all files are merged by `expert_key_prefix` (files repeat them; they must
    agree); every file must record the same `use_data_before_expert_parallelism`.

    Raises:
        RuntimeError: naming the file, for a malformed summary, conflicting AutoEP entries, or files that
            disagree on the ordering.
    """
    shapes_by_file: list[dict[str, Any]] = []
    layers_by_prefix: dict[str, dict[str, Any]] = {}
    layer_source: dict[str, str] = {}
    ordering_by_file: dict[str, bool] = {}
    for model_file, summary in model_state_metadata:
        shapes = summary[PARAM_SHAPES]
        if not isinstance(shapes, dict):
            raise RuntimeError(f"DeepSpeed checkpoint {PARAM_SHAPES} must contain dictionaries in {model_file}.")
        shapes_by_file.append(shapes)

        layers = summary[AUTOEP_LAYERS_KEY]
        if layers is not None:
            if not isinstance(layers, list):
                raise RuntimeError(f"AutoEP metadata must be a list in {model_file}.")
            for layer in layers:
                if not isinstance(layer, dict):
                    raise RuntimeError(f"AutoEP layer metadata must contain dictionaries in {model_file}.")
                prefix = layer.get(AUTOEP_EXPERT_KEY_PREFIX)
                if not isinstance(prefix, str) or not prefix:
                    raise RuntimeError(f"AutoEP {AUTOEP_EXPERT_KEY_PREFIX} must be a non-empty string in {model_file}.")
                seen = layers_by_prefix.setdefault(prefix, layer)
                layer_source.setdefault(prefix, model_file)
                if seen != layer:
                    raise RuntimeError(
                        f"Conflicting AutoEP metadata for {AUTOEP_EXPERT_KEY_PREFIX} {prefix!r} in "
                        f"{layer_source[prefix]} and {model_file}."
                    )

        config = summary[DS_CONFIG_KEY]
        if not isinstance(config, dict):
            raise RuntimeError(f"DeepSpeed checkpoint ds_config must be a dictionary in {model_file}.")
        ordering = config.get(USE_DATA_BEFORE_EXPERT_PARALLELISM, False)
        if not isinstance(ordering, bool):
            raise RuntimeError(
                f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} must be a boolean in {model_file}."
            )
        ordering_by_file[model_file] = ordering

    orderings = set(ordering_by_file.values())
    if len(orderings) != 1:
        raise RuntimeError(
            f"DeepSpeed checkpoint {USE_DATA_BEFORE_EXPERT_PARALLELISM} disagrees across model-state files: "
            f"{ordering_by_file}"
        )
    return shapes_by_file, list(layers_by_prefix.values()) or None, orderings.pop()
