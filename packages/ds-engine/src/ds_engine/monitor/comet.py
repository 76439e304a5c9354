"""`deepspeed.monitor.comet.CometMonitor`: built from the `comet` section."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ds_engine._report.monitors import CometMonitor as _Backend
from ds_engine.monitor._rank import is_rank_zero

__all__ = ["CometMonitor"]


class CometMonitor:
    """`enabled` and `samples_log_interval` from the section; a Comet experiment on rank 0 when enabled.

    Raises:
        ImportError: enabled without the comet_ml package.
    """

    def __init__(self, comet_config: Any) -> None:
        self.enabled = comet_config.enabled
        self.samples_log_interval = comet_config.samples_log_interval
        self._backend = None
        if self.enabled and is_rank_zero():
            self._backend = _Backend(
                samples_log_interval=comet_config.samples_log_interval,
                project=comet_config.project,
                workspace=comet_config.workspace,
                api_key=comet_config.api_key,
                experiment_name=comet_config.experiment_name,
                experiment_key=comet_config.experiment_key,
                online=comet_config.online,
                mode=comet_config.mode,
            )
        self.experiment = self._backend.experiment if self._backend is not None else None

    def write_events(self, event_list: Sequence[tuple[str, float, int]]) -> None:
        """Log each `(name, value, samples)`, each name at most once per `samples_log_interval` samples."""
        if self._backend is not None:
            self._backend.write_events(event_list)
