"""Read every rank's ZeRO optimizer-state file of a checkpoint, ds's or DeepSpeed's, as format-1 dicts.

The one entry point loaders use (`ds_zero.load_partition_state_dicts`, the engine, `zero_to_fp32`):
files go through `ds_comm.load_checkpoint_file` (restricted unpickling, errors naming the file), a
DeepSpeed file is checked for a version this reader knows and translated by `from_deepspeed` with the
parameter shapes of its model-states file. Everything is read and translated before anything is
returned, so a bad file leaves the caller's model and optimizer untouched.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_zero._checkpoint.deepspeed_format import from_deepspeed, is_deepspeed_state_dict

__all__ = ["deepspeed_model_states_file", "load_partition_state_dicts", "optim_files"]

_OPTIM_RE = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")


def optim_files(ckpt_dir: str | os.PathLike[str], mp_rank: int = 0) -> list[Path]:
    """The optimizer-state files of model-parallel rank `mp_rank`, one per data-parallel rank, in rank order.

    Raises:
        FileNotFoundError: none (names the pattern). ValueError: two files for one rank, or ranks missing.
    """
    found: dict[int, Path] = {}
    root = Path(ckpt_dir)
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        match = _OPTIM_RE.match(path.name)
        if not match or int(match.group(2)) != mp_rank:
            continue
        rank = int(match.group(1))
        if rank in found:
            raise ValueError(
                f"two optimizer-state files for rank {rank} in {ckpt_dir}: {found[rank].name} and "
                f"{path.name}; remove the stale one"
            )
        found[rank] = path
    if not found:
        raise FileNotFoundError(
            f"no [bf16_]zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt files in "
            f"{ckpt_dir}: not a ZeRO checkpoint (a stage-0 one holds no partitions); load with "
            "load_optimizer_states=False to take the module weights only"
        )
    ranks = sorted(found)
    if ranks != list(range(len(ranks))):
        raise ValueError(
            f"optimizer-state files in {ckpt_dir} cover ranks {ranks}; ranks "
            f"{sorted(set(range(max(ranks) + 1)) - set(ranks))} are missing"
        )
    return [found[r] for r in ranks]


def deepspeed_model_states_file(ckpt_dir: str | os.PathLike[str], mp_rank: int = 0) -> Path | None:
    """`mp_rank_XX_model_states.pt`, or (stage 3, DeepSpeed's name) dp rank 0's `zero_pp_rank_0_..._model_states.pt`."""
    for name in (f"mp_rank_{mp_rank:02d}_model_states.pt", f"zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt"):
        path = Path(ckpt_dir) / name
        if path.is_file():
            return path
    return None


def _model_dtype(module: Mapping[str, Any] | None, names: list[str]) -> torch.dtype:
    for name in names:
        value = (module or {}).get(name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    return torch.float32


def load_partition_state_dicts(
    ckpt_dir: str | os.PathLike[str], *, mp_rank: int = 0, mmap: bool = False
) -> list[dict[str, Any]]:
    """Every rank's optimizer partition in `ckpt_dir` (ds's or DeepSpeed's files), in rank order, in format 1.

    Raises:
        FileNotFoundError: no optimizer-state files, or a DeepSpeed checkpoint without its model-states file.
        ds_comm.CheckpointFileError: a file is truncated, corrupt, pickles a class outside the allow-list,
            or comes from a DeepSpeed newer than this reader knows (names the file).
        ValueError: ranks missing, or a DeepSpeed file whose layout does not add up.
    """
    files = optim_files(ckpt_dir, mp_rank)
    loaded = []
    for path in files:
        top = ds_comm.load_checkpoint_file(path, mmap=mmap)
        if not isinstance(top, Mapping) or "optimizer_state_dict" not in top:
            raise ds_comm.CheckpointFileError(f"{path}: no 'optimizer_state_dict' key; not a ZeRO optimizer-state file")
        ds_comm.check_deepspeed_version(top.get("ds_version"), path)
        loaded.append((path, top["optimizer_state_dict"]))
    if not any(is_deepspeed_state_dict(sd) for _, sd in loaded):
        return [dict(sd) for _, sd in loaded]
    states_file = deepspeed_model_states_file(ckpt_dir, mp_rank)
    if states_file is None:
        raise FileNotFoundError(
            f"{ckpt_dir} holds DeepSpeed optimizer files but no model-states file "
            "(mp_rank_00_model_states.pt or zero_pp_rank_0_mp_rank_00_model_states.pt): its "
            "param_shapes are needed to place the partitions"
        )
    states = ds_comm.load_checkpoint_file(states_file)
    param_shapes = [{name: list(shape) for name, shape in group.items()} for group in states.get("param_shapes") or []]
    if not param_shapes:
        raise ValueError(f"{states_file}: no param_shapes; DeepSpeed writes them with ZeRO, was it saved without?")
    dtype = _model_dtype(states.get("module"), [n for group in param_shapes for n in group])
    out = []
    for path, sd in loaded:
        rank = int(_OPTIM_RE.match(path.name).group(1))  # type: ignore[union-attr]  # matched by optim_files
        try:
            out.append(
                from_deepspeed(
                    sd,
                    dp_rank=rank,
                    param_shapes=param_shapes,
                    model_dtype=dtype,
                    shared_params=states.get("shared_params"),
                    frozen_param_shapes=states.get("frozen_param_shapes"),
                    partition_count=len(loaded),
                )
            )
        except (KeyError, TypeError) as err:
            raise ds_comm.CheckpointFileError(
                f"{path}: not a DeepSpeed ZeRO optimizer state this reader knows ({type(err).__name__}: {err})"
            ) from err
    return out
