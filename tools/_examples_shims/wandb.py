"""Stands in for `wandb` where a program imports it but the run leaves Weights & Biases off.

Nothing can reach wandb's servers from here; a call means the run asked for logging it cannot have.
"""

from __future__ import annotations

from typing import Any


def _offline(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("wandb is not available on this offline host: run the program without its wandb option")


init = log = finish = _offline
