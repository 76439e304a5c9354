"""Write a state_dict into a directory the way Hugging Face lays out model weights.

`pytorch_model.bin` (or `model.safetensors`) when it fits in `max_shard_size`; otherwise numbered shards
`pytorch_model-00001-of-00003.bin` ... and `pytorch_model.bin.index.json`, whose `weight_map` names each
tensor's shard. This is what DeepSpeed's `convert_zero_checkpoint_to_fp32_state_dict` writes and what
`transformers`' `from_pretrained` reads. DeepSpeed needs `huggingface_hub` to cut the shards; here they
are cut directly.

Tensors that share storage (tied weights) always land in the same shard and are counted once, so
`torch.load` of that shard gives back one tensor under both names. safetensors cannot store shared
tensors; there each extra name gets its own copy.

Every file is written whole or not at all (`ds_comm.atomic_write`); shards of an earlier, differently
cut conversion into the same directory are removed, so the directory never mixes two layouts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path

import torch

import ds_comm

__all__ = ["SAFE_WEIGHTS_NAME", "WEIGHTS_NAME", "parse_shard_size", "split_into_shards", "write_state_dict_dir"]

WEIGHTS_NAME = "pytorch_model.bin"
SAFE_WEIGHTS_NAME = "model.safetensors"

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", re.IGNORECASE)


def parse_shard_size(size: int | str | None) -> int | None:
    """Bytes per shard from `5GB` (10^9), `500MiB` (2^20), `1000` or an int; None: one file, no limit.

    Raises:
        ValueError: not a positive size in those spellings.
    """
    if size is None:
        return None
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str) and (match := _SIZE.match(size)):
        value = int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    else:
        raise ValueError(f"max_shard_size={size!r}: give bytes (an int) or a size such as '5GB' or '500MiB'")
    if value <= 0:
        raise ValueError(f"max_shard_size={size!r}: a shard must hold at least one byte")
    return value


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _nbytes(t: torch.Tensor) -> int:
    return t.untyped_storage().nbytes()


def split_into_shards(state_dict: Mapping[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    """The names of each shard, in state_dict order: tensors sharing storage stay together, and a shard is
    closed before it would exceed `max_bytes` (a single larger storage is a shard of its own)."""
    groups: dict[tuple[str, int], list[str]] = {}
    sizes: dict[tuple[str, int], int] = {}
    for name, value in state_dict.items():
        key = _storage_key(value) if isinstance(value, torch.Tensor) else ("object", id(value))
        groups.setdefault(key, []).append(name)
        sizes.setdefault(key, _nbytes(value) if isinstance(value, torch.Tensor) else 0)
    shards: list[list[str]] = [[]]
    filled = 0
    for key, names in groups.items():
        if max_bytes is not None and shards[-1] and filled + sizes[key] > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].extend(names)
        filled += sizes[key]
    order = {name: i for i, name in enumerate(state_dict)}
    return [sorted(names, key=order.__getitem__) for names in shards]


def _shard_name(base: str, index: int, count: int) -> str:
    stem, dot, suffix = base.rpartition(".")
    return f"{stem}-{index:05d}-of-{count:05d}{dot}{suffix}"


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    try:
        from safetensors.torch import save_file
    except ImportError as err:
        raise ImportError(
            "safe_serialization=True writes model.safetensors and needs the safetensors package: "
            "pip install safetensors (or leave safe_serialization off for pytorch_model.bin)"
        ) from err
    seen: set[tuple[str, int]] = set()
    own: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        key = _storage_key(t)
        own[name] = t.contiguous() if key not in seen else t.clone().contiguous()
        seen.add(key)
    ds_comm.atomic_write(path, lambda tmp: save_file(own, str(tmp), metadata={"format": "pt"}))


def write_state_dict_dir(
    state_dict: Mapping[str, torch.Tensor],
    output_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str | None = "5GB",
    safe_serialization: bool = False,
) -> list[Path]:
    """Write `state_dict` into `output_dir` (created) as one weights file or as shards plus an index.

    Returns:
        The files written, shards first and the index (when sharded) last.

    Raises:
        NotADirectoryError: `output_dir` exists and is a file.
        ValueError: a bad `max_shard_size`.
        ImportError: `safe_serialization` without the safetensors package.
    """
    limit = parse_shard_size(max_shard_size)
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"output_dir {out} is an existing file; give a directory to write the weights into")
    out.mkdir(parents=True, exist_ok=True)
    base = SAFE_WEIGHTS_NAME if safe_serialization else WEIGHTS_NAME
    shards = split_into_shards(state_dict, limit)
    files = [base] if len(shards) == 1 else [_shard_name(base, i + 1, len(shards)) for i in range(len(shards))]
    written = []
    for names, file in zip(shards, files, strict=True):
        part = {name: state_dict[name] for name in names}
        if safe_serialization:
            _save_safetensors(part, out / file)
        else:
            ds_comm.atomic_save(part, out / file)
        written.append(out / file)
    index = out / f"{base}.index.json"
    if len(shards) > 1:
        total = sum(
            _nbytes(t)
            for t in {_storage_key(t): t for t in state_dict.values() if isinstance(t, torch.Tensor)}.values()
        )
        weight_map = {name: file for names, file in zip(shards, files, strict=True) for name in names}
        index_json = {"metadata": {"total_size": total}, "weight_map": weight_map}
        ds_comm.atomic_write_text(index, json.dumps(index_json, indent=2, sort_keys=True) + "\n")
        written.append(index)
    _remove_other_layouts(out, base, keep={p.name for p in written})
    return written


def _remove_other_layouts(out: Path, base: str, keep: set[str]) -> None:
    """Delete what an earlier conversion with another shard count left beside the new files."""
    stem, _, suffix = base.rpartition(".")
    pattern = re.compile(rf"^{re.escape(stem)}-\d{{5}}-of-\d{{5}}\.{re.escape(suffix)}$")
    for path in out.iterdir():
        if path.name in keep:
            continue
        if pattern.match(path.name) or path.name in (base, f"{base}.index.json"):
            path.unlink()
