"""Sequence parallelism: DeepSpeed-Ulysses `DistributedAttention` and its all-to-all (`deepspeed.sequence`)."""

from __future__ import annotations

from ds_parallel.sequence._all_gather import all_gather_autograd
from ds_parallel.sequence._all_to_all import seq_all_to_all
from ds_parallel.sequence.layer import DistributedAttention, head_split_sizes

__all__ = ["DistributedAttention", "all_gather_autograd", "head_split_sizes", "seq_all_to_all"]
