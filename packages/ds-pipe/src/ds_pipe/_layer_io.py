"""Per-layer model checkpoints: one `layer_XX-model_states.pt` file per global layer index.

Files are named by the layer's global index (not by stage), so a model saved on 4 stages loads on
2, 1 or 8. Names follow DeepSpeed: `layer_{idx:02d}[-{rank_repr}]-model_states.pt`, where
`rank_repr` is the topology's tag without the pipe and data axes (`model_00` with tensor
parallelism, empty otherwise). Each file holds the layer's `state_dict()` (an empty dict for a
layer without state); a tied layer's file holds its tied module's state, in every occurrence.
Every file is written through `ds_comm.atomic_save` (a unique temporary name, fsync, rename), so
two writers never collide and a crash never leaves a torn layer file under its final name.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

import ds_comm

logger = logging.getLogger(__name__)


class CheckpointEngine(Protocol):
    """Anything that saves and loads objects by path (DeepSpeed's checkpoint engine interface)."""

    def save(self, state_dict: Any, path: str) -> None: ...

    def load(self, path: str, map_location: Any = None) -> Any: ...


def layer_file_name(layer_idx: int, rank_repr: str) -> str:
    """`layer_03-model_states.pt`, or `layer_03-model_01-model_states.pt` with a rank tag."""
    tag = f"-{rank_repr}" if rank_repr else ""
    return f"layer_{layer_idx:02d}{tag}-model_states.pt"


def _save(obj: Any, path: Path, engine: CheckpointEngine | None) -> None:
    """Write one layer file atomically (see `ds_comm.atomic_write`), through `engine` when one is given; an
    engine whose `publishes_atomically` is true (ds-engine's decoupled writer) is handed the final path."""
    if engine is None:
        ds_comm.atomic_save(obj, path)
    elif getattr(engine, "publishes_atomically", False):
        engine.save(obj, str(path))
    else:
        ds_comm.atomic_write(path, lambda tmp: engine.save(obj, str(tmp)))


def save_layers(
    layers: list[tuple[int, nn.Module | None]],
    save_dir: str | os.PathLike[str],
    rank_repr: str,
    *,
    exclude_frozen_params: bool = False,
    engine: CheckpointEngine | None = None,
) -> list[Path]:
    """Save each (global index, module) pair's state dict to its layer file; return the paths written.

    Tensors are cloned so a file holds only its own data (a view would drag its whole storage along).
    Entries whose module is None (plain functions) write nothing.
    """
    directory = Path(save_dir)
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for layer_idx, module in layers:
        if module is None:
            continue
        state = module.state_dict()
        if exclude_frozen_params:
            frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        state = type(state)((k, v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items())
        path = directory / layer_file_name(layer_idx, rank_repr)
        _save(state, path, engine)
        written.append(path)
    logger.debug("saved %d layer files to %s", len(written), directory)
    return written


def load_layers(
    layers: list[tuple[int, nn.Module | None]],
    load_dir: str | os.PathLike[str],
    rank_repr: str,
    *,
    strict: bool = True,
    engine: CheckpointEngine | None = None,
) -> None:
    """Load each module's state from its layer file (saved by `save_layers`, with any stage count).

    Raises:
        FileNotFoundError: a layer file is missing (the message lists the layer files present).
        RuntimeError: `strict` and the keys differ (from `load_state_dict`, naming the layer file).
    """
    directory = Path(load_dir)
    loaded: set[int] = set()
    for layer_idx, module in layers:
        if module is None or id(module) in loaded:
            continue  # a tied module appearing twice on this stage loads once
        path = directory / layer_file_name(layer_idx, rank_repr)
        if not path.exists():
            present = sorted(p.name for p in directory.glob("layer_*model_states.pt"))[:8]
            raise FileNotFoundError(
                f"load_state_dir: no checkpoint for layer {layer_idx}: {path} is missing "
                f"(layer files present: {present or 'none'}); was it saved with the same model "
                "and tensor-parallel degree?"
            )
        if engine is not None:
            state = engine.load(str(path), map_location="cpu")
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
        try:
            module.load_state_dict(state, strict=strict)
        except RuntimeError as err:
            raise RuntimeError(
                f"load_state_dir: {path.name} does not match layer {layer_idx} ({type(module).__name__}): {err}"
            ) from err
        loaded.add(id(module))
