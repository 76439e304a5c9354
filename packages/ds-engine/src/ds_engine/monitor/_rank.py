"""Monitors write on global rank 0 only; before any process group exists the process counts as rank 0."""

from __future__ import annotations

import torch.distributed as dist


def is_rank_zero() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0
