"""Checkpoint directory layout (DeepSpeed's names), atomic writes, and save/load helpers for standalone use.

Layout of `save_dir/<tag>/` (the engine writes the same files):
`mp_rank_00_model_states.pt` (data-parallel rank 0: the module's state_dict and metadata) and one
`zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt` per rank (`{"optimizer_state_dict": ...}`), plus the
text file `save_dir/latest` holding the tag (no newline), written last. Every file goes through
`ds_comm.atomic_save` (temporary name, fsync, rename), so a failed save never replaces a good file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_comm import atomic_save, atomic_write_text
from ds_zero.__about__ import __version__
from ds_zero._checkpoint.partition_files import _OPTIM_RE, load_partition_state_dicts

logger = logging.getLogger(__name__)

__all__ = [
    "MODEL_STATES_FILE",
    "find_model_states_file",
    "load_zero_checkpoint",
    "optim_states_file_name",
    "read_latest_tag",
    "resolve_checkpoint_dir",
    "save_zero_checkpoint",
    "zero_param_shapes",
]

MODEL_STATES_FILE = "mp_rank_00_model_states.pt"
_STAGE3_MODEL_STATES_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def optim_states_file_name(dp_rank: int, *, bf16: bool = False) -> str:
    """`[bf16_]zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt` (DeepSpeed's name)."""
    return f"{'bf16_' if bf16 else ''}zero_pp_rank_{dp_rank}_mp_rank_00_optim_states.pt"


def read_latest_tag(save_dir: str | os.PathLike[str]) -> str:
    """The tag in `save_dir/latest`.

    Raises:
        FileNotFoundError: there is no `latest` file (names the directory; pass a tag instead).
    """
    latest = Path(save_dir) / "latest"
    if not latest.is_file():
        raise FileNotFoundError(
            f"no 'latest' file in {save_dir}: pass tag=... (a subdirectory name) or point at the tag directory itself"
        )
    return latest.read_text().strip()


def find_model_states_file(ckpt_dir: str | os.PathLike[str]) -> Path | None:
    """`mp_rank_00_model_states.pt` (stages 1/2) or rank 0's stage-3 model-states file, if present."""
    for name in (MODEL_STATES_FILE, _STAGE3_MODEL_STATES_FILE):
        path = Path(ckpt_dir) / name
        if path.is_file():
            return path
    return None


def resolve_checkpoint_dir(checkpoint_dir: str | os.PathLike[str], tag: str | None = None) -> Path:
    """The tag directory: `checkpoint_dir/tag`, `checkpoint_dir/<latest>`, or `checkpoint_dir` itself when it
    already holds the optimizer-state files."""
    root = Path(checkpoint_dir)
    if tag is not None:
        path = root / str(tag)
    elif (root / "latest").is_file():
        path = root / read_latest_tag(root)
    elif any(_OPTIM_RE.match(p.name) for p in root.iterdir()) if root.is_dir() else False:
        path = root
    else:
        raise FileNotFoundError(
            f"no 'latest' file in {root} and no optimizer-state files there: pass the save "
            "directory that holds 'latest', or tag=..."
        )
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    return path


def zero_param_shapes(optimizer: Any, module: torch.nn.Module) -> list[dict[str, list[int]]]:
    """Per param group, name -> shape of the trainable parameters of a ZeRO optimizer (DeepSpeed's
    `param_shapes`), in the order of its flat partitions."""
    flats = getattr(optimizer, "flats", None)
    if flats is not None:
        return [{slot.name: list(slot.shape) for slot in flat.slots} for flat in flats]
    names = {id(p): n for n, p in module.named_parameters()}
    return [
        {
            names.get(id(p), f"group{g}.param{i}"): list(getattr(p, "ds_shape", p.shape))
            for i, p in enumerate(group["params"])
            if p.requires_grad
        }
        for g, group in enumerate(optimizer.param_groups)
    ]


def zero_sub_group_param_shapes(optimizer: Any, module: torch.nn.Module) -> list[dict[str, list[int]]]:
    """Like `zero_param_shapes`, but per sub-group of the base optimizer: at stage 3 each `sub_group_size`
    tile is a base-optimizer parameter with its own state (DeepSpeed's `_get_zero_param_shapes` lists
    stage 3's sub-groups); at stages 1 and 2 a sub-group is a param group's flat partition."""
    per_tile = getattr(optimizer, "sub_group_param_shapes", None)
    if per_tile is not None:
        return per_tile()
    return zero_param_shapes(optimizer, module)


def _model_states(optimizer: Any, module: torch.nn.Module, client_state: Mapping[str, Any]) -> dict[str, Any]:
    state = {
        "module": module.state_dict(),
        "buffer_names": [name for name, _ in module.named_buffers()],
        "optimizer": None,
        "param_shapes": zero_param_shapes(optimizer, module),
        "frozen_param_shapes": dict(getattr(optimizer, "frozen_param_shapes", {})),
        "shared_params": dict(getattr(optimizer, "shared_params", {})),
        "dp_world_size": optimizer.dp_world_size,
        "zero_stage": optimizer.zero_stage,
        "ds_zero_version": __version__,
    }
    state.update(client_state)
    return state


def save_zero_checkpoint(
    save_dir: str | os.PathLike[str],
    tag: str,
    optimizer: Any,
    module: torch.nn.Module | None = None,
    *,
    client_state: Mapping[str, Any] | None = None,
    save_latest: bool = True,
    bf16_prefix: bool = False,
) -> Path:
    """Save a ZeRO checkpoint in DeepSpeed's layout (a collective: every data-parallel rank calls it).

    Each rank writes its `optimizer.state_dict()`; data-parallel rank 0 also writes the model states
    (when `module` is given; at stage 3 every rank writes its own) and, after every rank has finished,
    `save_dir/latest`. The optimizer needs `dp_rank`, `dp_world_size`, `dp_group`, `zero_stage`,
    `param_groups` and `state_dict()` (both stage families have them).

    Args:
        save_dir: the checkpoint root.
        tag: the subdirectory name (e.g. `global_step100`).
        optimizer: a ds_zero ZeRO optimizer.
        module: the model (for buffers, frozen parameters and a loadable module state_dict).
        client_state: extra keys stored in the model-states file.
        save_latest: update `save_dir/latest` to `tag`.
        bf16_prefix: name the optimizer files `bf16_zero_pp_rank_...` as DeepSpeed does for bf16 runs.

    Returns:
        The tag directory.
    """
    if not str(tag):
        raise ValueError("tag must be a non-empty string")
    path = Path(save_dir) / str(tag)
    path.mkdir(parents=True, exist_ok=True)
    rank = optimizer.dp_rank
    atomic_save(
        {"optimizer_state_dict": optimizer.state_dict(), "ds_zero_version": __version__},
        path / optim_states_file_name(rank, bf16=bf16_prefix),
    )
    if module is not None:
        # Stages 1/2: one model-states file (rank 0). Stage 3: every rank writes its own (DeepSpeed's names).
        if optimizer.zero_stage == 3:
            atomic_save(
                _model_states(optimizer, module, client_state or {}),
                path / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt",
            )
        elif rank == 0:
            atomic_save(_model_states(optimizer, module, client_state or {}), path / MODEL_STATES_FILE)
    if ds_comm.is_initialized():
        ds_comm.barrier(group=optimizer.dp_group)
    if rank == 0 and save_latest:
        atomic_write_text(Path(save_dir) / "latest", str(tag))
    if ds_comm.is_initialized():
        ds_comm.barrier(group=optimizer.dp_group)
    return path


def load_optim_state_dicts(ckpt_dir: str | os.PathLike[str], *, mmap: bool = True) -> list[dict[str, Any]]:
    """Every rank's `optimizer_state_dict` from `ckpt_dir` (ds's or DeepSpeed's files), in rank order, in format 1.

    Restricted unpickling; see `ds_zero._checkpoint.partition_files.load_partition_state_dicts`.
    """
    return load_partition_state_dicts(ckpt_dir, mmap=mmap)


def load_zero_checkpoint(
    load_dir: str | os.PathLike[str],
    optimizer: Any,
    module: torch.nn.Module | None = None,
    *,
    tag: str | None = None,
    load_optimizer_states: bool = True,
    load_module_strict: bool = True,
) -> tuple[Path | None, dict[str, Any] | None]:
    """Load a stage 1/2 checkpoint written by `save_zero_checkpoint` (or the engine), at any world size.

    The module's weights come from the model-states file (when `module` is given), then every rank's
    partition file re-partitions onto this optimizer (a collective: every rank calls it).

    Returns `(tag directory, client_state)`, or `(None, None)` with a warning when `load_dir` has no
    `latest` and no tag is given (DeepSpeed's behaviour).
    """
    if tag is None and not (Path(load_dir) / "latest").is_file():
        logger.warning("no 'latest' file in %s; nothing loaded", load_dir)
        return None, None
    path = resolve_checkpoint_dir(load_dir, tag)
    client_state: dict[str, Any] = {}
    states_file = find_model_states_file(path)
    if module is not None and states_file is not None:
        states = torch.load(states_file, map_location="cpu", weights_only=False)
        module.load_state_dict(states.pop("module"), strict=load_module_strict)
        client_state = states
    optimizer.load_state_dict(
        load_optim_state_dicts(path), load_optimizer_states=load_optimizer_states, load_from_fp32_weights=True
    )
    return path, client_state
