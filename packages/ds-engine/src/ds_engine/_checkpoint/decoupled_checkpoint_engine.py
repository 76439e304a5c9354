"""`DecoupledCheckpointEngine`: DeepSpeed's checkpoint engine for `checkpoint.writer.decoupled: true`, by path.

`engine.checkpoint_engine` is one when the config asks for decoupled writes: a file a script saves through it
(`checkpoint_engine.save(state, path)`) is snapshot and written by the engine's background worker, through the
same atomic publish as the engine's own files; `commit(info)` waits until every rank's queued files are written
and raises a failed write, naming the file (`_checkpoint.decoupled`). Made alone (DeepSpeed's signature), it
starts a worker of its own over the config's writer.
"""

from __future__ import annotations

import enum
import logging
import os
from typing import Any

import torch

from ds_engine._checkpoint.checkpoint_engine import CheckpointCommitInfo
from ds_engine._checkpoint.decoupled import DecoupledWriter
from ds_engine._checkpoint.file_writer import CheckpointFileWriter
from ds_engine._checkpoint.torch_checkpoint_engine import TorchCheckpointEngine
from ds_engine._plan.dist_info import DistInfo

logger = logging.getLogger(__name__)

__all__ = ["ENGINE_NAME", "DecoupledCheckpointEngine", "DecoupledEvent"]

ENGINE_NAME = "DecoupledCheckpointEngine"


class DecoupledEvent(enum.Enum):
    """The messages DeepSpeed's engine sends its writer process (kept for scripts that name them)."""

    SAVE_EVENT = 1
    COMMIT_EVENT = 2
    EXIT_EVENT = 3


class DecoupledCheckpointEngine(TorchCheckpointEngine):
    """Saves in the background, atomically; `commit` waits for the writes; loads with `torch.load`.

    Args:
        config_params: a `DeepSpeedConfig` with a `checkpoint.writer` section.
        dp_writer_config: DeepSpeed's data-parallel writer description; None: this rank writes nothing (it
            still takes part in `commit`, a collective).
        optimize_dp_state: accepted for DeepSpeed's signature.
        writer: the engine's background writer to share, else one is made over the config's writer.
    """

    name = ENGINE_NAME

    def __init__(
        self,
        config_params: Any,
        dp_writer_config: Any = True,
        optimize_dp_state: bool = False,
        *,
        writer: DecoupledWriter | None = None,
    ) -> None:
        super().__init__(config_params)
        if writer is None:
            model = getattr(config_params, "parsed", None)
            if model is None or model.checkpoint.writer is None:
                raise ValueError(
                    "DecoupledCheckpointEngine needs a DeepSpeedConfig with a checkpoint.writer section "
                    '(e.g. {"checkpoint": {"writer": {"decoupled": true}}})'
                )
            files = CheckpointFileWriter(model.checkpoint.writer, model.aio, DistInfo(), torch.device("cpu"))
            writer = DecoupledWriter(files.save, DistInfo(), torch.device("cpu"))
        # Every rank keeps the writer: `commit` is a collective, also on a rank that writes nothing.
        self._writer = writer
        self._writes = dp_writer_config is not None
        self.dp_writer_config = dp_writer_config
        self.optimize_dp_state = optimize_dp_state
        self.commit_info: CheckpointCommitInfo | None = None

    def create(self, info: CheckpointCommitInfo) -> None:
        """A checkpoint under `info.tag` begins; `commit(info)` ends it."""
        self.commit_info = info

    def save(self, state_dict: Any, path: str | os.PathLike[str]) -> None:
        """Snapshot `state_dict` and queue its atomic write to `path` (nothing on a non-writer rank)."""
        if self._writes:
            self._writer.save(state_dict, path, serialization=self.zipfile_serialization)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Wait until every rank's queued files are written (collective); True.

        Raises:
            ValueError: `info` is not the checkpoint `create` began (DeepSpeed raises too).
            DecoupledCheckpointError: a queued write failed, naming the file.
        """
        if self.commit_info is not None and info != self.commit_info:
            raise ValueError(
                f"[{ENGINE_NAME}] Checkpoint commit info mismatch: expected {self.commit_info}, got {info}"
            )
        self._writer.flush(info.tag)
        self.commit_info = None
        return True

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        """The checkpoint `create` began, else the engine's save still to be committed."""
        if self.commit_info is not None:
            return self.commit_info
        pending = self._writer.pending
        if pending is None:
            return None
        return CheckpointCommitInfo(tag=pending.tag, save_dir=str(pending.save_dir), save_latest=pending.save_latest)

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:
        self.commit_info = info

    def is_decoupled(self) -> bool:
        return True

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether this rank writes through this engine (it was given a data-parallel writer description)."""
        return self._writes

    def cleanup(self) -> None:
        """Wait for the queued files (DeepSpeed commits the open checkpoint here; failures are logged)."""
        try:
            if self.commit_info is not None:
                self.commit(self.commit_info)
            else:
                self._writer.drain()
        except Exception as err:  # noqa: BLE001 - DeepSpeed's cleanup logs and goes on
            logger.warning("[%s] Error during commit in cleanup: %s", ENGINE_NAME, err)
