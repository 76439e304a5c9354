"""The process-wide AutoTP mode (training or inference), as DeepSpeed's `set_autotp_mode` keeps it.

The mode is read once, when a layer is sharded: training layers keep their weights trainable and use
out-of-place collectives autograd can differentiate; inference layers freeze their weights and reduce
in place.
"""

from __future__ import annotations

import enum

__all__ = ["AutoTPMode", "get_autotp_mode", "is_autotp_training_mode", "set_autotp_mode"]


class AutoTPMode(enum.Enum):
    """What sharded layers are built for."""

    TRAINING = "TRAINING"
    INFERENCE = "INFERENCE"


_MODE = AutoTPMode.INFERENCE


def set_autotp_mode(training: bool = False) -> None:
    """Shard for training (`training=True`) or inference (the default, as in DeepSpeed)."""
    global _MODE
    _MODE = AutoTPMode.TRAINING if training else AutoTPMode.INFERENCE


def get_autotp_mode() -> AutoTPMode:
    return _MODE


def is_autotp_training_mode() -> bool:
    return _MODE is AutoTPMode.TRAINING
