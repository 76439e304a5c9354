"""`deepspeed.checkpoint.reshape_utils`: the pieces the reshape maps are built from.

`partition_data` cuts a list of source ranks into equal contiguous runs (one run per target rank);
`get_files` / `get_zero_files` list a tag directory's files, the ZeRO ones in DeepSpeed's rank order
(data-parallel rank major, then model-parallel rank), which is the order the 3D maps index into;
`merge_state` folds the optimizer states of several source ranks into one (tensors concatenated on
dim 0, nested dicts and lists merged entry by entry, anything else taken from the first). A 0-d
tensor is a scalar, such as torch's per-parameter `step` counter, which every partition holds alike:
it is taken from the first too (concatenating it would fail).
"""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, TypeVar

import torch

from ds_engine._checkpoint.constants import BF16_ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, ZERO_FILE_PREFIX

__all__ = [
    "basic_folder_validation",
    "get_files",
    "get_files_with_prefix",
    "get_zero_files",
    "merge_state",
    "partition_data",
]

T = TypeVar("T")


def basic_folder_validation(dir: str | os.PathLike[str]) -> None:  # noqa: A002 - DeepSpeed's argument name
    """Raise FileNotFoundError / NotADirectoryError unless `dir` is an existing folder."""
    if not os.path.exists(dir):
        raise FileNotFoundError(f"checkpoint folder {os.fspath(dir)} does not exist")
    if not os.path.isdir(dir):
        raise NotADirectoryError(f"checkpoint path {os.fspath(dir)} is not a folder")


def get_files(dir: str | os.PathLike[str]) -> list[str]:  # noqa: A002 - DeepSpeed's argument name
    """The paths of the files directly inside `dir`, sorted (a tag directory is flat; subfolders are skipped)."""
    return sorted(entry.path for entry in os.scandir(dir) if entry.is_file())


def get_files_with_prefix(all_files: Sequence[str], prefix: str) -> list[str]:
    """The paths in `all_files` whose file name starts with `prefix`, sorted."""
    return sorted(path for path in all_files if os.path.basename(path).startswith(prefix))


def get_zero_files(dir: str | os.PathLike[str]) -> list[str]:  # noqa: A002 - DeepSpeed's argument name
    """The optimizer-state files of `dir`, ordered by (data-parallel rank, model-parallel rank).

    Plain `zero_pp_rank_*` files are preferred, then `fp16_`, then `bf16_` (one kind per checkpoint).
    """
    files = get_files(dir)
    for prefix in (ZERO_FILE_PREFIX, FP16_ZERO_FILE_PREFIX, BF16_ZERO_FILE_PREFIX):
        pattern = re.compile(rf"^{re.escape(prefix)}(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
        ranked = []
        for path in files:
            if m := pattern.match(os.path.basename(path)):
                ranked.append(((int(m.group(1)), int(m.group(2))), path))
        if ranked:
            return [path for _, path in sorted(ranked)]
    return []


def partition_data(data_list: Sequence[T], num_partitions: int) -> list[list[T]]:
    """`data_list` cut into `num_partitions` contiguous runs of equal length.

    Raises:
        ValueError: `num_partitions` is not positive or does not divide the length.
    """
    if num_partitions < 1 or len(data_list) % num_partitions:
        raise ValueError(f"cannot split {len(data_list)} entries into {num_partitions} equal partitions")
    size = len(data_list) // num_partitions
    return [list(data_list[i : i + size]) for i in range(0, len(data_list), size)]


def _where(key_list: Sequence[str]) -> str:
    return ".".join(key_list) or "<top level>"


def merge_state(state_a: Any, state_b: Any, key_list: Sequence[str] = ()) -> Any:
    """`state_b` folded into `state_a`: tensors concatenated on dim 0 (0-d ones kept from `state_a`),
    containers merged entry by entry.

    Raises:
        ValueError: the two states differ in type, or two lists differ in length, at `key_list`.
    """
    if type(state_a) is not type(state_b):
        raise ValueError(
            f"cannot merge a {type(state_a).__name__} with a {type(state_b).__name__} at {_where(key_list)}"
        )
    if isinstance(state_a, (dict, OrderedDict)):
        merged = type(state_a)(state_a)  # a key only one side has is kept as it is
        for key, value in state_b.items():
            merged[key] = merge_state(state_a[key], value, [*key_list, str(key)]) if key in state_a else value
        return merged
    if isinstance(state_a, (list, tuple)):
        if len(state_a) != len(state_b):
            raise ValueError(f"cannot merge lists of lengths {len(state_a)} and {len(state_b)} at {_where(key_list)}")
        pairs = enumerate(zip(state_a, state_b, strict=True))
        return type(state_a)(merge_state(a, b, [*key_list, str(i)]) for i, (a, b) in pairs)
    if torch.is_tensor(state_a) and state_a.dim() > 0:
        return torch.cat([state_a, state_b], 0)
    return state_a
