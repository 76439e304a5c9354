"""TensorBoard monitor through `torch.utils.tensorboard` (needs the `tensorboard` package)."""

from __future__ import annotations

import importlib.util
import logging
import os
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

__all__ = ["TensorBoardMonitor", "tensorboard_available"]


def tensorboard_available() -> bool:
    """Whether `torch.utils.tensorboard` can be imported (it needs the separate `tensorboard` package)."""
    return importlib.util.find_spec("tensorboard") is not None


class TensorBoardMonitor:
    """Scalars to `<output_path>/<job_name>` with a `SummaryWriter`.

    Raises:
        ImportError: the tensorboard package is not installed (the message says how to fix it).
    """

    def __init__(self, output_path: str, job_name: str) -> None:
        if not tensorboard_available():
            raise ImportError(
                "tensorboard.enabled is true but the tensorboard package is not installed: "
                "pip install tensorboard (or set tensorboard.enabled to false, or use csv_monitor)"
            )
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = Path(output_path or os.path.join(os.getcwd(), "runs")) / job_name
        self.writer = SummaryWriter(log_dir=str(self.log_dir))

    def write_events(self, events: Sequence[tuple[str, float, int]]) -> None:
        for name, value, step in events:
            self.writer.add_scalar(name, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
