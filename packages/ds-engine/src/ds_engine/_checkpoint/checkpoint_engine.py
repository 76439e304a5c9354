"""`CheckpointEngine`: the interface the engine saves and loads checkpoint files through (DeepSpeed's ABC).

A checkpoint is bracketed by `create(info)` and `commit(info)`; in between every file goes through
`save(state_dict, path)`. ds's engines (`TorchCheckpointEngine`, `FastCheckpointEngine`) derive from it; a
script may derive its own (DeepSpeed's documented extension point) and hand it to code that takes one.
"""

from __future__ import annotations

import abc
import dataclasses
import os
from typing import Any

__all__ = ["CheckpointCommitInfo", "CheckpointEngine"]


@dataclasses.dataclass
class CheckpointCommitInfo:
    """Which checkpoint `create`/`commit` are about (DeepSpeed's fields)."""

    tag: str
    save_dir: str
    save_latest: bool


class CheckpointEngine(abc.ABC):
    """Saves and loads checkpoint files by path; the defaults describe a synchronous, rank-0 writer."""

    name: str | None = None

    def __init__(self, config_params: Any = None) -> None:  # noqa: B027 - subclasses read what they need
        pass

    @abc.abstractmethod
    def create(self, info: CheckpointCommitInfo) -> None:
        """A checkpoint under `info.tag` begins."""

    @abc.abstractmethod
    def save(self, state_dict: Any, path: str) -> None:
        """Write one file."""

    def makedirs(self, path: str | os.PathLike[str], exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    @abc.abstractmethod
    def load(self, path: str, map_location: Any = None) -> Any:
        """Read one file."""

    @abc.abstractmethod
    def commit(self, info: CheckpointCommitInfo) -> bool:
        """Every file of `info.tag` is written; True when the checkpoint is complete."""

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        """Whether data-parallel rank `dp_rank` writes the replicated files (rank 0 by default)."""
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        """Whether saves finish in the background (never, for ds's engines)."""
        return False

    def set_commit_info(self, info: CheckpointCommitInfo) -> None:  # noqa: B027 - a no-op unless decoupled
        pass

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        return None

    def cleanup(self) -> None:  # noqa: B027 - a no-op unless decoupled
        pass

    def preserves_storage_sharing(self) -> bool:
        """Whether tensors sharing storage are saved once (torch.save does)."""
        return True
