"""Weights & Biases monitor: each event becomes `run.log({name: value}, step=global_samples)` (needs `wandb`)."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["WandbMonitor", "wandb_available"]


def wandb_available() -> bool:
    """Whether the `wandb` package can be imported."""
    return importlib.util.find_spec("wandb") is not None


def require_wandb() -> None:
    """Raise the explanatory ImportError when `wandb` is missing (checked before any rank starts a run)."""
    if not wandb_available():
        raise ImportError(
            "wandb.enabled is true but the wandb package is not installed: pip install wandb "
            "(or set wandb.enabled to false, or use csv_monitor)"
        )


class WandbMonitor:
    """One wandb run for the job, started at construction with DeepSpeed's mapping of the config.

    `team` is wandb's `entity`. The run's mode (online, offline, disabled) and directory follow
    wandb's own environment (`WANDB_MODE`, `WANDB_DIR`, ...), as in DeepSpeed.

    Args:
        project: wandb project.
        group: wandb group (runs of one experiment), or None.
        team: wandb entity, or None (the user's default).

    Raises:
        ImportError: wandb is not installed (the message says how to fix it).
    """

    def __init__(self, project: str, group: str | None, team: str | None) -> None:
        require_wandb()
        import wandb

        self.run: Any = wandb.init(project=project, group=group, entity=team)

    def write_events(self, events: Sequence[tuple[str, float, int]]) -> None:
        # Events of one call share their step; wandb merges logs with the same step into one row.
        for name, value, step in events:
            self.run.log({name: value}, step=step)

    def close(self) -> None:
        self.run.finish()
