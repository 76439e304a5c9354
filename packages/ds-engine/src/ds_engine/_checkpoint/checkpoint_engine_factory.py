"""`create_checkpoint_engine`: DeepSpeed's choice of checkpoint engine for a config, over ds's engines.

With a `checkpoint.writer` section: a `DecoupledCheckpointEngine` (`writer.decoupled`) or a
`FastCheckpointEngine`, each given this rank's data-parallel writer description (None on a rank that
writes no replicated file, so its saves write nothing, as in DeepSpeed); otherwise a `TorchCheckpointEngine`.
An engine made here owns its writer; `engine.checkpoint_engine` instead shares the engine's.
"""

from __future__ import annotations

from typing import Any

from ds_engine._checkpoint.decoupled_checkpoint_engine import DecoupledCheckpointEngine
from ds_engine._checkpoint.dp_writer_config import create_data_parallel_writer_config
from ds_engine._checkpoint.fast_checkpoint_engine import FastCheckpointEngine
from ds_engine._checkpoint.torch_checkpoint_engine import TorchCheckpointEngine

__all__ = ["create_checkpoint_engine"]


def create_checkpoint_engine(
    config_params: Any, groups: Any, zero_stage: int, has_moe_layers: bool, optimize_dp_state: bool
) -> TorchCheckpointEngine:
    """The checkpoint engine `config_params` (a `DeepSpeedConfig`, or None) asks for; see the module docstring."""
    model = getattr(config_params, "parsed", None)
    writer = model.checkpoint.writer if model is not None else None
    if writer is None:
        return TorchCheckpointEngine(config_params)
    dp_writer_config = create_data_parallel_writer_config(
        groups=groups, parallel_unit=writer.data_parallel, zero_stage=zero_stage, has_moe_layers=has_moe_layers
    )
    if writer.decoupled:
        return DecoupledCheckpointEngine(config_params, dp_writer_config, optimize_dp_state)
    return FastCheckpointEngine(config_params, dp_writer_config, optimize_dp_state)
