"""Comet monitor: events go to a `comet_ml` experiment, each name at most once per `samples_log_interval`."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["CometMonitor", "comet_available"]


def comet_available() -> bool:
    """Whether the `comet_ml` package can be imported."""
    return importlib.util.find_spec("comet_ml") is not None


def require_comet() -> None:
    """Raise the explanatory ImportError when `comet_ml` is missing (checked before any rank starts)."""
    if not comet_available():
        raise ImportError(
            "comet.enabled is true but the comet_ml package is not installed: pip install comet_ml "
            "(or set comet.enabled to false, or use csv_monitor)"
        )


class _LogThrottle:
    """Per event name: log the first value, then only once `interval` samples have passed since the last logged one.

    Why: Comet rate-limits metric uploads, so DeepSpeed thins the per-step events by samples seen.
    """

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._last: dict[str, int] = {}

    def due(self, name: str, samples: int) -> bool:
        last = self._last.get(name)
        if last is not None and samples - last < self.interval:
            return False
        self._last[name] = samples
        return True


class CometMonitor:
    """A Comet experiment started with `comet_ml.start(...)`, keyed by DeepSpeed's `comet` section.

    Args:
        samples_log_interval: log an event name again only after this many more samples.
        project, workspace, api_key, experiment_key, mode, online: passed to `comet_ml.start`
            (None: Comet's own configuration, `COMET_*` variables or `.comet.config`).
        experiment_name: set as the experiment's name when given.

    Raises:
        ImportError: comet_ml is not installed (the message says how to fix it).
    """

    def __init__(
        self,
        *,
        samples_log_interval: int,
        project: str | None = None,
        workspace: str | None = None,
        api_key: str | None = None,
        experiment_name: str | None = None,
        experiment_key: str | None = None,
        online: bool | None = None,
        mode: str | None = None,
    ) -> None:
        require_comet()
        import comet_ml

        self.samples_log_interval = samples_log_interval
        self.experiment: Any = comet_ml.start(
            api_key=api_key,
            project=project,
            workspace=workspace,
            experiment_key=experiment_key,
            mode=mode,
            online=online,
        )
        if experiment_name is not None:
            self.experiment.set_name(experiment_name)
        self._throttle = _LogThrottle(samples_log_interval)

    def write_events(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            if self._throttle.due(name, step):
                self.experiment.log_metric(name, value, step=step)

    def close(self) -> None:
        self.experiment.end()
