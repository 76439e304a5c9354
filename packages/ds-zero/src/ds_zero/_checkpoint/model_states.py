"""The fields of a model-states file that describe tied and frozen parameters, written and read as DeepSpeed does.

Beside `module`, DeepSpeed 0.19.8 writes into every model-states file of a ZeRO checkpoint:

* `shared_params`: `{alias: stored name}` for tied parameters (one tensor under two names). The alias
  has no value of its own in the optimizer partitions; a consolidation gives it the stored name's
  tensor. Global rank 0's file has the mapping, the other ranks' stage-3 files `{}`.
* `frozen_param_shapes` and `frozen_param_fragments` (ZeRO 2 and 3; None at stage 1 and when saved with
  `exclude_frozen_parameters`): name -> full shape (a `torch.Size`) and name -> value of every parameter
  no optimizer partition holds (`requires_grad=False`, or no elements). At stage 2 the value is the whole
  parameter. At stage 3 each data-parallel rank's `zero_pp_rank_{r}_..._model_states.pt` holds its own
  slice, `ceil(numel / world)` elements with the last rank's tail zero-padded, and `module` holds an
  empty placeholder for every parameter (frozen and tied ones included).

DeepSpeed's `zero_to_fp32.py` reads exactly these (and fails on a None `shared_params`); ds's readers use
`read_frozen_params` and `with_shared` to rebuild what a stage-3 file keeps only as placeholders.
ds's own layout writes one model-states file holding the whole module: there each fragment is the whole
parameter, the same tensor as its `module` entry (so the file stores it once).
"""

from __future__ import annotations

import math
import os
import re
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

import ds_comm

__all__ = [
    "frozen_fields",
    "read_frozen_params",
    "shared_param_names",
    "stage3_fragment",
    "with_shared",
]

_STAGE3_MODEL_RE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")


def shared_param_names(module: torch.nn.Module) -> dict[str, str]:
    """`{alias: stored name}` of `module`'s tied parameters, DeepSpeed's `shared_params`: the first name a
    parameter is reached by (module order, as `state_dict` walks it) stores it, later names alias it."""
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        stored = first.setdefault(id(param), name)
        if stored != name:
            aliases[name] = stored
    return aliases


def stage3_fragment(value: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """Rank `rank`'s stage-3 slice of `value`: `ceil(numel / world)` elements, zero-padded past the end."""
    flat = value.detach().reshape(-1)
    size = -(-flat.numel() // world)
    out = flat.new_zeros(size)
    lo, hi = min(flat.numel(), rank * size), min(flat.numel(), (rank + 1) * size)
    out[: hi - lo] = flat[lo:hi]
    return out


def frozen_fields(
    module_state: Mapping[str, Any],
    frozen: Iterable[str],
    *,
    stage: int,
    shapes: Mapping[str, Sequence[int]] | None = None,
    rank: int | None = None,
    world: int = 1,
) -> tuple[OrderedDict[str, torch.Size] | None, OrderedDict[str, torch.Tensor] | None]:
    """`(frozen_param_shapes, frozen_param_fragments)` as DeepSpeed writes them at ZeRO `stage`.

    Args:
        module_state: the module's state_dict holding the frozen parameters' full values.
        frozen: the names of the parameters no optimizer partition holds, in module order.
        shapes: full shapes where `module_state` holds a placeholder (default: the values' shapes).
        rank: None: every fragment is the whole parameter, `module_state`'s own tensor (stage 2; flattened at
            stage 3, ds's one-file layout); else this data-parallel rank's stage-3 slice of `world`.

    Returns:
        `(None, None)` below stage 2 (DeepSpeed records frozen parameters from stage 2 on).
    """
    if stage < 2:
        return None, None
    names = list(frozen)
    out_shapes = OrderedDict((n, torch.Size((shapes or {}).get(n, module_state[n].shape))) for n in names)
    if rank is None:  # a stage-3 fragment is flat (DeepSpeed joins the ranks' fragments end to end)
        return out_shapes, OrderedDict(
            (n, module_state[n].reshape(-1) if stage == 3 else module_state[n]) for n in names
        )
    return out_shapes, OrderedDict((n, stage3_fragment(module_state[n], rank, world)) for n in names)


def _model_states_files(ckpt_dir: Path, mp_rank: int) -> list[Path]:
    """DeepSpeed's stage-3 files of `mp_rank` in data-parallel rank order, or the one `mp_rank_XX` file."""
    ranked = {}
    for path in ckpt_dir.iterdir() if ckpt_dir.is_dir() else []:
        match = _STAGE3_MODEL_RE.match(path.name)
        if match and int(match.group(2)) == mp_rank:
            ranked[int(match.group(1))] = path
    if ranked:
        if sorted(ranked) != list(range(len(ranked))):
            raise ValueError(
                f"{ckpt_dir}: stage-3 model-states files of mp_rank {mp_rank:02d} cover data-parallel ranks "
                f"{sorted(ranked)}; every rank's file is needed to rebuild the frozen parameters"
            )
        return [ranked[r] for r in range(len(ranked))]
    single = ckpt_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"
    return [single] if single.is_file() else []


def read_frozen_params(
    ckpt_dir: str | os.PathLike[str], mp_rank: int = 0, *, states: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, torch.Tensor]:
    """The frozen parameters' full values from the model-states files' `frozen_param_fragments`.

    A DeepSpeed stage-3 checkpoint keeps them only there, sliced over every data-parallel rank's file;
    the slices are joined in rank order and cut to the recorded shape. `states`: the files' dicts,
    already loaded, in that order (default: read from `ckpt_dir`). Empty when none were recorded.

    Raises:
        ValueError: a rank's file is missing, or the fragments do not add up to the recorded shape.
    """
    if states is None:
        states = [ds_comm.load_checkpoint_file(p) for p in _model_states_files(Path(ckpt_dir), mp_rank)]
    if not states:
        return {}
    shapes = states[0].get("frozen_param_shapes") or {}
    out = {}
    for name, shape in shapes.items():
        pieces = [(s.get("frozen_param_fragments") or {}).get(name) for s in states]
        if any(p is None for p in pieces):
            raise ValueError(f"{ckpt_dir}: frozen parameter {name!r} has no fragment in every model-states file")
        flat = torch.cat([p.reshape(-1) for p in pieces])
        numel = math.prod(shape)
        if flat.numel() < numel:
            raise ValueError(
                f"{ckpt_dir}: the fragments of frozen parameter {name!r} hold {flat.numel()} elements, "
                f"its shape {list(shape)} needs {numel}"
            )
        out[name] = flat[:numel].view(tuple(shape)).clone()
    return out


def with_shared(state_dict: Mapping[str, Any], shared: Mapping[str, str] | None) -> dict[str, Any]:
    """`state_dict` with each tied alias given its stored parameter's tensor (the same object)."""
    out = dict(state_dict)
    for alias, stored in (shared or {}).items():
        if stored in out:
            out[alias] = out[stored]
    return out
