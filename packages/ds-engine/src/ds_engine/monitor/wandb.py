"""`deepspeed.monitor.wandb.WandbMonitor`: built from the `wandb` section."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ds_engine._report.monitors import WandbMonitor as _Backend
from ds_engine.monitor._rank import is_rank_zero

__all__ = ["WandbMonitor"]


class WandbMonitor:
    """`enabled`, `group`, `team` and `project` from the section; a wandb run on rank 0 when enabled.

    Raises:
        ImportError: enabled without the wandb package.
    """

    def __init__(self, wandb_config: Any) -> None:
        self.enabled = wandb_config.enabled
        self.group = wandb_config.group
        self.team = wandb_config.team
        self.project = wandb_config.project
        self._backend = _Backend(self.project, self.group, self.team) if self.enabled and is_rank_zero() else None

    def write_events(self, event_list: Sequence[tuple[str, float, int]]) -> None:
        """Log each `(name, value, step)` to the run."""
        if self._backend is not None:
            self._backend.write_events(event_list)
