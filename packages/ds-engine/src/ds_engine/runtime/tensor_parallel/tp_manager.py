"""`deepspeed.runtime.tensor_parallel.tp_manager`: `TpTrainingManager`, AutoTP for training done up front.

DeepSpeed's class shards a model for tensor-parallel training at construction: it reads the block
policies (`AutoTP.tp_parser`), builds the tensor-parallel groups, gives the ranks of each group the same
RNG state (so later random initialisation and dropout agree across shards), and replaces the linear
layers. ds does the same with ds-parallel (the `parallel` extra): the process-wide mesh with a `tp` dim of
`tp_size`, then `ds_parallel.tensor.shard_model` in training mode. The model is marked
`ds_autotp_parsed`, so `initialize()` with `tensor_parallel.autotp_size` equal to `tp_size` trains it
without sharding it again.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_comm import get_accelerator
from ds_engine._optional import require
from ds_engine._parallel.tensor_parallel import tensor_parallel_mpu
from ds_engine.config._tensor_parallel import TensorParallelConfig, TPConfig
from ds_engine.module_inject.auto_tp import AutoTP

logger = logging.getLogger(__name__)

__all__ = ["TpTrainingManager"]


class TpTrainingManager:
    """Shard `model` (in place) for tensor-parallel training over `tp_size` consecutive ranks.

    Args:
        model: the whole model, on every rank (the same weights: each rank keeps its shard).
        tp_size: the tensor-parallel degree; the world size must be a multiple of it.
        dtype: recorded in `config.dtype` (the training dtype comes from initialize()'s config).

    Attributes:
        module: `model`, sharded.
        config: the `tensor_parallel` section model (`TPTrainingConfig`) with `dtype` and `tp`.
        tp_config: `TPConfig` with `tp_size` and the tensor-parallel `tp_group`.
        model_config: the model's Hugging Face `config`, if it has one.

    Raises:
        ValueError: a bad `tp_size`, a world size it does not divide, or a model AutoTP cannot shard.
        ImportError: ds-parallel is missing (names `pip install 'ds-engine[parallel]'`).
    """

    def __init__(self, model: nn.Module, tp_size: int, dtype: torch.dtype) -> None:
        if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
            raise ValueError(f"TpTrainingManager: tp_size must be a positive int, got {tp_size!r}")
        tensor = require("ds_parallel", extra="parallel", feature="TpTrainingManager").tensor
        self.module = model
        policies = AutoTP.tp_parser(model)
        logger.info("AutoTP: %s", policies)
        ds_comm.init_distributed(verbose=False)
        group = tensor_parallel_mpu(tp_size).get_model_parallel_group()
        self.tp_config = TPConfig(tp_size=tp_size, tp_group=group)
        self.config = TensorParallelConfig(dtype=dtype, autotp_size=tp_size, tensor_parallel=self.tp_config)
        self.model_config: Any = getattr(model, "config", None)
        _share_rng_state(group)
        tensor.set_autotp_mode(training=True)
        tensor.shard_model(model, tp_group=group, training=True)
        model.ds_autotp_parsed = True  # type: ignore[assignment]  # DeepSpeed's marker: initialize() keeps it


def _share_rng_state(group: Any) -> None:
    """Give every rank of `group` its first rank's CPU (and accelerator) RNG state (one broadcast each)."""
    if ds_comm.get_world_size(group) == 1:
        return
    src = ds_comm.get_global_rank(group, 0)
    acc = get_accelerator()
    device = torch.device("cpu") if acc.name == "cpu" else acc.device(ds_comm.get_local_rank())
    states = [(torch.get_rng_state(), torch.set_rng_state)]
    if acc.name != "cpu":
        states.append((acc.get_rng_state(), acc.set_rng_state))
    for state, restore in states:
        moved = state.to(device)
        ds_comm.broadcast(moved, src=src, group=group)
        restore(moved.cpu())
