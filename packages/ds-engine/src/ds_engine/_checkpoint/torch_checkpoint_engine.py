"""`TorchCheckpointEngine`: torch.save / torch.load by path, each save atomic (DeepSpeed's default engine).

DeepSpeed's engine writes with a bare `torch.save`; here every file goes through `ds_comm.atomic_save`
(temporary name, fsync, rename), so a crash mid-write never leaves a truncated file under the final
name. `create` and `commit` bracket a checkpoint as in DeepSpeed; with synchronous writes there is
nothing to wait for, so `commit` returns True.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ds_comm import atomic_save
from ds_engine._checkpoint.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

logger = logging.getLogger(__name__)

__all__ = ["CheckpointCommitInfo", "TorchCheckpointEngine"]


class TorchCheckpointEngine(CheckpointEngine):
    """Saves and loads checkpoint files with torch.

    Args:
        config_params: a `DeepSpeedConfig` (its `checkpoint.checkpoint_serialization` picks torch's
            zipfile format) or None (zipfile format).
    """

    name = "TorchCheckpointEngine"

    def __init__(self, config_params: Any = None) -> None:
        super().__init__(config_params)
        model = getattr(config_params, "parsed", None)
        self.zipfile_serialization = bool(model.checkpoint.checkpoint_serialization) if model is not None else True

    def create(self, info: CheckpointCommitInfo) -> None:
        """A checkpoint under `info.tag` begins (nothing to prepare for synchronous writes)."""
        logger.debug("checkpoint %s begins in %s", info.tag, info.save_dir)

    def makedirs(self, path: str | os.PathLike[str], exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str | os.PathLike[str]) -> None:
        """Write `state_dict` to `path` atomically, in the configured serialization format."""
        atomic_save(state_dict, path, serialization=self.zipfile_serialization)

    def load(self, path: str | os.PathLike[str], map_location: Any = None) -> Any:
        """`torch.load(path)` of a checkpoint file (full unpickling: checkpoints hold Python objects)."""
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of `info.tag` is written (they were, synchronously): True."""
        return True
