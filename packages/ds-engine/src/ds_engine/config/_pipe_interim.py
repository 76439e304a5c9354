"""ds-engine's copies of the `pipeline` and `activation_checkpointing` section models, for any ds_config.

[Note: swap] These sections belong to ds-pipe, which exports its own `PipelineConfig` and
`ActivationCheckpointingConfig`; a `PipelineEngine` validates the sections again with those
(`_pipeline.py`). These copies check them when ds-pipe is not installed. Replacing the two imports
in `_toplevel.py` with ds-pipe's models (through `ds_engine._optional.require`, or by making the
fields plain dicts validated lazily as `zero_optimization` is) deletes this file. Keys and defaults
follow DeepSpeed 0.19.8; unlike DeepSpeed, unknown keys are errors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from ds_comm import ConfigModel
from ds_engine.config._types import NonNegInt, PosInt

__all__ = ["ActivationCheckpointingConfig", "PipelineConfig"]


class PipelineConfig(ConfigModel):
    """`pipeline`: pipeline-parallel engine options (used only when the model is a ds_pipe.PipelineModule)."""

    stages: Literal["auto"] | PosInt = "auto"
    """Number of pipeline stages; "auto" takes the PipelineModule's own."""
    partition: str = "best"
    """Layer partitioning hint."""
    seed_layers: bool = False
    """Seed each layer's RNG from its index."""
    activation_checkpoint_interval: NonNegInt = 0
    """Checkpoint activations every N layers (0: off)."""
    pipe_partitioned: bool = True
    """Partition activations sent between stages across tensor-parallel ranks."""
    grad_partitioned: bool = True
    """Partition gradients sent between stages across tensor-parallel ranks."""


class ActivationCheckpointingConfig(ConfigModel):
    """`activation_checkpointing`: read by `checkpointing.configure(...)` when a script calls it."""

    partition_activations: bool = False
    """Partition checkpointed activations across model-parallel ranks."""
    contiguous_memory_optimization: bool = False
    """Copy checkpoints into one contiguous buffer (needs number_checkpoints)."""
    cpu_checkpointing: bool = False
    """Move checkpoints to CPU memory (needs partition_activations)."""
    number_checkpoints: PosInt | None = None
    """How many checkpoints the contiguous buffer holds."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronize the device at checkpoint boundaries."""
    profile: bool = False
    """Time the checkpointed forward/backward."""

    @model_validator(mode="after")
    def _requirements(self) -> ActivationCheckpointingConfig:
        if self.cpu_checkpointing and not self.partition_activations:
            raise ValueError("cpu_checkpointing=true needs partition_activations=true")
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError("contiguous_memory_optimization=true needs number_checkpoints")
        return self
