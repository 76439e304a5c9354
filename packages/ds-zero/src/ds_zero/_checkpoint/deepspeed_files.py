"""DeepSpeed 0.19.8's files of one model-parallel rank, written from a ds save: shared by `to_deepspeed`
(every data-parallel rank at once) and the engine's `checkpoint.layout: "deepspeed"` save (each rank its own).

From the ds save's tag directory it writes, for the data-parallel ranks asked for:

* the model-states file: `mp_rank_XX_model_states.pt` (stages 1/2, data-parallel rank 0 writes it) or
  `zero_pp_rank_{r}_mp_rank_XX_model_states.pt` (stage 3, every rank its own, each parameter an empty
  placeholder), with `param_shapes`, `frozen_param_shapes`, `shared_params`, `frozen_param_fragments`
  (stage 3: rank r's slices; `ds_zero._checkpoint.model_states`), `dp_world_size` and `ds_version` as
  DeepSpeed writes them;
* `[bf16_]zero_pp_rank_{r}_mp_rank_XX_optim_states.pt`: rank r's partition in DeepSpeed's layout
  (`deepspeed_export`).

The partitions are read memory-mapped when asked (`mmap=True`), so a rank writing its own file touches
only the pages of the fragments it needs, not every rank's whole partition.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_comm.checkpoint_files import deepspeed_pickle_names, load_checkpoint_file
from ds_zero._checkpoint.deepspeed_export import DEEPSPEED_VERSION, deepspeed_rank_state_dict
from ds_zero._checkpoint.format import FragmentIndex
from ds_zero._checkpoint.model_states import frozen_fields, read_frozen_params
from ds_zero._checkpoint.partition_files import deepspeed_model_states_file, load_partition_state_dicts

__all__ = ["write_deepspeed_files"]


def _module_dtype(module: dict[str, Any], names: Sequence[str], part: dict[str, Any]) -> torch.dtype:
    """The training dtype: the module's parameters' (a pipeline stage has none there: the partition's)."""
    for name in names:
        value = module.get(name)
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.dtype
    saved = part.get("model_dtype")
    return getattr(torch, saved) if isinstance(saved, str) and hasattr(torch, saved) else torch.float32


def _param_shapes(states: dict[str, Any], index: FragmentIndex) -> list[OrderedDict[str, torch.Size]]:
    """The model-states file's `param_shapes`, or (a pipeline stage's file, ds before 0.1 wrote `[{}]` under
    ZeRO) the parameters in flat order: every rank's fragments in rank order, by position in the partition."""
    saved = states.get("param_shapes")
    if saved and all(saved):
        return [OrderedDict((n, torch.Size(s)) for n, s in group.items()) for group in saved]
    groups: dict[int, OrderedDict[str, torch.Size]] = {}
    for sd in index.state_dicts:
        for meta in sd["partitions"]:
            group = groups.setdefault(int(meta["group_index"]), OrderedDict())
            for name, *_, _start in sorted(meta["fragments"], key=lambda f: int(f[3])):
                group.setdefault(name, torch.Size(meta["param_shapes"][name]))
    return [groups[g] for g in sorted(groups)]


def _frozen_params(
    states_file: Path, states: dict[str, Any], module: dict[str, Any], held: set[str], mp_rank: int
) -> dict[str, torch.Tensor]:
    """The frozen parameters' whole values, in module order: from the model-states files' fragments (every
    rank's file for DeepSpeed's stage 3), or, for ds saves that hold them whole in the module, every entry that
    is no buffer, no trainable parameter (`held`, tied names included) and no placeholder."""
    if states.get("frozen_param_fragments") is not None:
        one_file = states_file.name == f"mp_rank_{mp_rank:02d}_model_states.pt"
        return read_frozen_params(states_file.parent, mp_rank, states=[states] if one_file else None)
    buffers = set(states.get("buffer_names") or [])
    return {
        n: v
        for n, v in module.items()
        if n not in held and n not in buffers and isinstance(v, torch.Tensor) and v.numel() > 0
    }


def write_deepspeed_files(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    mp_rank: int = 0,
    dp_ranks: Iterable[int] | None = None,
    world_size: int | None = None,
    stage: int | None = None,
    pipeline: bool = False,
    serialization: bool = True,
    mmap: bool = False,
) -> None:
    """Write DeepSpeed's model-states and optimizer files of model-parallel rank `mp_rank` of the ds save in `src`.

    Args:
        src: the ds save's tag directory (its `mp_rank_XX_model_states.pt` and every rank's partition).
        out: the tag directory to write into (created when missing).
        mp_rank: the model-parallel rank (pipeline stage) whose files are written.
        dp_ranks: the data-parallel ranks (of `world_size`) whose files are written; None: all of them.
            Rank 0 writes the stage-1/2 model-states file; at stage 3 every rank writes its own.
        world_size: DeepSpeed's data-parallel world size (default: the save's).
        stage: DeepSpeed's ZeRO stage (default: the save's).
        pipeline: `src` is a pipeline checkpoint (DeepSpeed's pipeline engine takes ZeRO stage 1 at most).
        serialization: torch's zipfile format (False: the legacy one).
        mmap: read the partitions memory-mapped (only the needed fragments' pages are read).

    Raises:
        FileNotFoundError: no model-states or optimizer files. ValueError: a bad world size or stage,
            a pipeline checkpoint asked for ZeRO stage 2 or 3, or a data-parallel rank outside the world.
    """
    src, out = Path(src), Path(out)
    parts = load_partition_state_dicts(src, mp_rank=mp_rank, mmap=mmap)
    index = FragmentIndex(parts)
    states_file = deepspeed_model_states_file(src, mp_rank)
    if states_file is None:
        raise FileNotFoundError(f"{src} has no mp_rank_{mp_rank:02d}_model_states.pt")
    states = load_checkpoint_file(states_file, mmap=mmap)
    world = int(world_size or parts[0]["partition_count"])
    stage = int(stage or parts[0]["zero_stage"])
    if world < 1 or stage not in (1, 2, 3):
        raise ValueError(f"world_size must be >= 1 and stage 1, 2 or 3; got {world} and {stage}")
    if pipeline and stage > 1:
        raise ValueError(
            f"{src} is a pipeline checkpoint: DeepSpeed's pipeline engine takes ZeRO stage 0 or 1, not {stage}"
        )
    ranks = list(range(world)) if dp_ranks is None else sorted(set(dp_ranks))
    if any(not 0 <= r < world for r in ranks):
        raise ValueError(f"dp_ranks {ranks} must lie in 0..{world - 1} (the data-parallel world size)")
    shapes = _param_shapes(states, index)
    names = [n for group in shapes for n in group]
    shared = dict(states.get("shared_params") or {})
    module = dict(states.get("module") or {})
    frozen = _frozen_params(states_file, states, module, {*names, *shared}, mp_rank)
    module.update(frozen)  # whole values where a stage-3 save held placeholders
    dtype = _module_dtype(module, names, parts[0])
    prefix = "bf16_" if dtype == torch.bfloat16 else ""
    out.mkdir(parents=True, exist_ok=True)
    frozen_shapes, frozen_values = frozen_fields(module, frozen, stage=stage)
    model_states = {
        # DeepSpeed's files hold no RNG state (its load leaves the RNG alone), so ds's `rng_states` is not copied
        **{k: v for k, v in states.items() if k != "rng_states"},
        # None stays None (a pipeline's model-states file: its layers are in files of their own).
        "module": None if states.get("module") is None and not module else OrderedDict(module),
        "param_shapes": shapes,
        "frozen_param_shapes": frozen_shapes,
        "shared_params": shared,
        "frozen_param_fragments": frozen_values,
        "dp_world_size": world,
        "ds_version": DEEPSPEED_VERSION,
    }
    ds_config = states.get("ds_config") or {}
    with deepspeed_pickle_names():
        if stage == 3:
            # Every parameter, frozen and tied ones too, is an empty placeholder; each rank's file holds its
            # slices of the frozen ones, and global rank 0's the tied names.
            params = {*names, *frozen, *shared}
            placeholders = {n: torch.empty(0, dtype=module[n].dtype if n in module else dtype) for n in params}
            stage3_module = OrderedDict((k, placeholders.get(k, v)) for k, v in module.items())
            for rank in ranks:
                _, fragments = frozen_fields(module, frozen, stage=3, rank=rank, world=world)
                stage3_states = {
                    **model_states,
                    "module": stage3_module,
                    "frozen_param_fragments": fragments,
                    "shared_params": shared if rank == 0 else {},
                }
                ds_comm.atomic_save(
                    stage3_states,
                    out / f"zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_model_states.pt",
                    serialization=serialization,
                )
        elif 0 in ranks:
            ds_comm.atomic_save(
                model_states, out / f"mp_rank_{mp_rank:02d}_model_states.pt", serialization=serialization
            )
        for rank in ranks:
            sd = deepspeed_rank_state_dict(index, shapes, world=world, rank=rank, stage=stage)
            ds_comm.atomic_save(
                {"optimizer_state_dict": sd, "ds_config": ds_config, "ds_version": DEEPSPEED_VERSION},
                out / f"{prefix}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt",
                serialization=serialization,
            )
