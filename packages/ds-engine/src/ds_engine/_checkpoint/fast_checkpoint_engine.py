"""`FastCheckpointEngine`: DeepSpeed's checkpoint engine for `checkpoint.writer` (FastPersist), by path.

`engine.checkpoint_engine` is one when the config has a `checkpoint.writer` section: scripts that save their
own files through it (`checkpoint_engine.save(state, path)`) get the configured writer and ds's atomic publish,
as the engine's own checkpoint files do.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ds_engine._checkpoint.file_writer import CheckpointFileWriter
from ds_engine._checkpoint.torch_checkpoint_engine import TorchCheckpointEngine
from ds_engine._plan.dist_info import DistInfo

logger = logging.getLogger(__name__)

__all__ = ["FastCheckpointEngine"]


class FastCheckpointEngine(TorchCheckpointEngine):
    """Saves through the `checkpoint.writer` writer, atomically; loads with `torch.load`.

    Args:
        config_params: a `DeepSpeedConfig` with a `checkpoint.writer` section.
        dp_writer_config: DeepSpeed's data-parallel writer description; a file saved through this object is
            written by the calling rank alone, so only its presence matters (None: this rank writes nothing,
            as in DeepSpeed).
        optimize_dp_state: accepted for DeepSpeed's signature; the engine's own REPLICA writes decide this.
        file_writer: the engine's writer to share (its staging buffer and I/O workers), else one is made.
    """

    name = "FastCheckpointEngine"

    def __init__(
        self,
        config_params: Any,
        dp_writer_config: Any = True,
        optimize_dp_state: bool = False,
        *,
        file_writer: CheckpointFileWriter | None = None,
    ) -> None:
        super().__init__(config_params)
        model = getattr(config_params, "parsed", None)
        if file_writer is None:
            if model is None or model.checkpoint.writer is None:
                raise ValueError(
                    "FastCheckpointEngine needs a DeepSpeedConfig with a checkpoint.writer section "
                    '(e.g. {"checkpoint": {"writer": {"type": "fast"}}})'
                )
            file_writer = CheckpointFileWriter(model.checkpoint.writer, model.aio, DistInfo(), torch.device("cpu"))
        self._writer = file_writer if dp_writer_config is not None else None
        self.optimize_dp_state = optimize_dp_state

    def save(self, state_dict: Any, path: str | os.PathLike[str]) -> None:
        """Write `state_dict` to `path` through the configured writer, atomically (nothing on a non-writer rank)."""
        if self._writer is None:
            return
        self._writer.save(state_dict, path, serialization=self.zipfile_serialization)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether this rank writes through this engine (it was given a data-parallel writer description)."""
        return self._writer is not None
