"""Config sections ds-pipe owns: `pipeline` and `activation_checkpointing`.

The engine validates the user's sections with `ds_comm.validate_section(PipelineConfig, ...,
path="pipeline")`; errors name the key path. Unlike DeepSpeed, which merges these sections into a
defaults dict and keeps unknown keys silently, an unknown key here is an error with a suggestion.
"""

from __future__ import annotations

import logging
import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from ds_comm import Auto, ConfigModel

logger = logging.getLogger(__name__)

__all__ = ["ActivationCheckpointingConfig", "PipelineConfig"]

#: Partition methods a `PipelineModule` understands (plus `type:<regex>`).
PARTITION_METHODS = ("uniform", "parameters")


class PipelineConfig(ConfigModel):
    """The `pipeline` section: how the engine builds and drives a `PipelineModule`."""

    stages: Annotated[int, Field(ge=1)] | Auto = "auto"
    """Number of pipeline stages; "auto" takes the `PipelineModule`'s own `num_stages`."""
    partition: str = "best"
    """How layers are split over stages: "best" keeps the module's own `partition_method`;
    otherwise "uniform", "parameters" or "type:<regex>" overrides it."""
    seed_layers: bool = False
    """Seed the RNG per layer (base_seed + layer index) when building and running layers, so
    initialisation and dropout do not depend on the partition."""
    activation_checkpoint_interval: Annotated[int, Field(ge=0)] = 0
    """Checkpoint every this many layers inside each stage (0 = off)."""
    use_reentrant: bool = True
    """Checkpoint with `checkpointing.checkpoint` (an autograd Function that reruns the block); False
    uses `checkpointing.non_reentrant_checkpoint` (torch's saved-tensor hooks) instead."""
    pipe_partitioned: bool = True
    """With tensor parallelism (a `model` axis > 1), send only this rank's 1/mp slice of each
    activation to the next stage, which all-gathers it over its tensor-parallel group."""
    grad_partitioned: bool = True
    """The same for the gradients sent back to the previous stage."""

    @field_validator("partition")
    @classmethod
    def _check_partition(cls, value: str) -> str:
        method = value.lower()
        if method == "best" or method in PARTITION_METHODS:
            return method
        if method.startswith("type:"):
            try:
                re.compile(value[len("type:") :], re.IGNORECASE)
            except re.error as err:
                raise ValueError(f"'type:' needs a valid regular expression after it ({err}), got {value!r}") from None
            return value
        raise ValueError(
            f"unknown partition method {value!r}; use 'best', 'uniform', 'parameters' or "
            "'type:<regex>' (e.g. 'type:TransformerBlock')"
        )


class ActivationCheckpointingConfig(ConfigModel):
    """The `activation_checkpointing` section: how `ds_pipe.checkpointing.checkpoint` stores its inputs."""

    partition_activations: bool = False
    """Keep only this rank's 1/mp slice of each checkpointed input across the tensor-parallel group
    (inputs are replicated there) and all-gather it before recomputation."""
    contiguous_memory_optimization: bool = False
    """Copy each checkpoint's saved inputs into one of `number_checkpoints` reusable flat buffers,
    so long runs do not fragment device memory. Needs `number_checkpoints`."""
    cpu_checkpointing: bool = False
    """Move the saved inputs to host memory until backward (frees device memory, costs copies)."""
    number_checkpoints: Annotated[int, Field(ge=1)] | None = None
    """How many checkpoints are alive at once (buffer count for `contiguous_memory_optimization`)."""
    synchronize_checkpoint_boundary: bool = False
    """Synchronise the device at the start and end of each checkpointed forward and recomputation."""
    profile: bool = False
    """Accumulate the time spent in checkpointed forward, recomputation and backward
    (`ds_pipe.checkpointing.timings()`)."""

    @model_validator(mode="after")
    def _contiguous_needs_count(self) -> ActivationCheckpointingConfig:
        if self.contiguous_memory_optimization and self.number_checkpoints is None:
            raise ValueError(
                "contiguous_memory_optimization needs number_checkpoints, the number of layers checkpointed "
                "(checkpoints alive at once, e.g. layers per stage x micro-batches in flight; configure() "
                "takes it as num_checkpoints)"
            )
        return self
