"""Reading a ds_config from a dict, a JSON/hjson file or a base64 string; finding and filling "auto" values."""

from __future__ import annotations

import base64
import binascii
import copy
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import hjson

from ds_engine.config._errors import DeepSpeedConfigError
from ds_engine.config._feature_sections import ExpertParallelConfig

__all__ = ["AUTO", "fill_auto", "find_auto_paths", "load_raw", "without_paths"]

AUTO = "auto"
#: Keys where "auto" is a real value DeepSpeed defines, not a placeholder for a caller to fill.
_LITERAL_AUTO = {
    "pipeline.stages",
    "data_types.keep_in_fp32_modules",
    # ZenFlow's own "auto" modes (adaptive intervals), not placeholders for a caller to fill.
    "zero_optimization.zenflow.select_strategy",
    "zero_optimization.zenflow.select_interval",
    "zero_optimization.zenflow.update_interval",
    # AutoEP's values resolved from the model.
    *(f"expert_parallel.{key}" for key in ExpertParallelConfig.literal_auto),
}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    duplicates = []
    for key, value in pairs:
        if key in seen:
            duplicates.append(key)
        seen[key] = value
    if duplicates:
        raise DeepSpeedConfigError(f"duplicate keys in the config: {sorted(set(duplicates))}")
    return seen


def _plain(value: Any) -> Any:
    """hjson's OrderedDicts -> dicts, recursively (they print and compare like the JSON the user wrote)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _from_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as err:
        raise DeepSpeedConfigError(f"cannot read config file {str(path)!r}: {err}") from None
    try:
        return hjson.loads(text, object_pairs_hook=_no_duplicates)
    except hjson.HjsonDecodeError as err:
        raise DeepSpeedConfigError(f"config file {str(path)!r} is not valid JSON/hjson: {err}") from None


def _from_base64(text: str) -> dict[str, Any] | None:
    try:
        decoded = base64.urlsafe_b64decode(text.encode() + b"=" * (-len(text) % 4)).decode()
        return json.loads(decoded, object_pairs_hook=_no_duplicates)
    except (binascii.Error, UnicodeDecodeError, json.JSONDecodeError, ValueError):
        return None


def load_raw(config: str | os.PathLike[str] | Mapping[str, Any]) -> dict[str, Any]:
    """The config as a fresh dict (the caller's object is never modified).

    Args:
        config: a mapping; a path to a JSON or hjson file (comments and unquoted keys are fine);
            or urlsafe-base64-encoded JSON (what launchers pass on command lines).

    Raises:
        DeepSpeedConfigError: unreadable or invalid file, duplicate keys, undecodable string, or a
            top level that is not an object.
        TypeError: `config` is none of the above types.
    """
    if isinstance(config, Mapping):
        raw: Any = copy.deepcopy(dict(config))
    elif isinstance(config, (str, os.PathLike)):
        path = Path(config)
        text = str(config)
        if path.is_file():
            raw = _from_file(path)
        elif text.endswith((".json", ".hjson")) or os.sep in text:
            raise DeepSpeedConfigError(f"config file {text!r} does not exist")
        else:
            raw = _from_base64(text)
            if raw is None:
                shown = text if len(text) < 60 else text[:57] + "..."
                raise DeepSpeedConfigError(
                    f"expected a path to an existing config file, a dict, or base64-encoded JSON; got {shown!r}"
                )
    else:
        raise TypeError(f"config must be a dict, a file path or a base64 string, got {type(config).__name__}")
    raw = _plain(raw)
    if not isinstance(raw, dict):
        raise DeepSpeedConfigError(f"the config must be a JSON object at the top level, got {type(raw).__name__}")
    return raw


def find_auto_paths(raw: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted key paths whose value is the placeholder string "auto", in document order."""
    found: list[str] = []
    for key, value in raw.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, str) and value == AUTO and path not in _LITERAL_AUTO:
            found.append(path)
        elif isinstance(value, Mapping):
            found.extend(find_auto_paths(value, path))
    return found


def fill_auto(raw: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with each "auto" placeholder whose path is in `values` replaced.

    Values for keys the config sets explicitly are ignored (the user's setting wins, as in the
    HF Trainer integration); values for keys the config does not mention are ignored too.
    """
    filled = copy.deepcopy(dict(raw))
    for path in find_auto_paths(filled):
        if path not in values:
            continue
        *parents, leaf = path.split(".")
        node = filled
        for part in parents:
            node = node[part]
        node[leaf] = copy.deepcopy(values[path])
    return filled


def without_paths(raw: Mapping[str, Any], paths: list[str]) -> dict[str, Any]:
    """A copy of `raw` without the keys at `paths` (how unfilled "auto" keys sit out validation)."""
    pruned = copy.deepcopy(dict(raw))
    for path in paths:
        *parents, leaf = path.split(".")
        node = pruned
        for part in parents:
            node = node[part]
        node.pop(leaf, None)
    return pruned
