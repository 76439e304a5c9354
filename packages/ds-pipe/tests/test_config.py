"""Config models: defaults, validation, and errors that name the key path."""

from __future__ import annotations

import pytest

from ds_comm import ConfigError, validate_section
from ds_pipe import ActivationCheckpointingConfig, PipelineConfig


def test_pipeline_defaults_match_deepspeed() -> None:
    cfg = validate_section(PipelineConfig, {}, path="pipeline")
    assert cfg.model_dump() == {
        "stages": "auto",
        "partition": "best",
        "seed_layers": False,
        "activation_checkpoint_interval": 0,
        "use_reentrant": True,
        "pipe_partitioned": True,
        "grad_partitioned": True,
    }


def test_pipeline_values() -> None:
    cfg = validate_section(
        PipelineConfig,
        {"stages": 4, "partition": "Uniform", "seed_layers": True, "activation_checkpoint_interval": 2},
        path="pipeline",
    )
    assert (cfg.stages, cfg.partition, cfg.seed_layers, cfg.activation_checkpoint_interval) == (4, "uniform", True, 2)
    assert validate_section(PipelineConfig, {"partition": "type:Block"}, path="pipeline").partition == "type:Block"


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"stages": 0}, "pipeline.stages"),
        ({"partition": "profile"}, "pipeline.partition: .*unknown partition method 'profile'"),
        ({"partition": "type:("}, "pipeline.partition: .*valid regular expression"),
        ({"activation_checkpoint_interval": -1}, "pipeline.activation_checkpoint_interval"),
        ({"stage": 2}, "pipeline.stage: unknown key 'stage'; did you mean 'stages'"),
        ({"pipe_partitioned": "maybe"}, "pipeline.pipe_partitioned"),
    ],
)
def test_pipeline_errors_name_the_key(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_section(PipelineConfig, section, path="pipeline")


def test_activation_checkpointing_defaults() -> None:
    cfg = validate_section(ActivationCheckpointingConfig, {}, path="activation_checkpointing")
    assert cfg.model_dump() == {
        "partition_activations": False,
        "contiguous_memory_optimization": False,
        "cpu_checkpointing": False,
        "number_checkpoints": None,
        "synchronize_checkpoint_boundary": False,
        "profile": False,
    }


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"contiguous_memory_optimization": True}, "contiguous_memory_optimization needs number_checkpoints"),
        ({"number_checkpoints": 0}, "activation_checkpointing.number_checkpoints"),
        ({"partition_activation": True}, "unknown key 'partition_activation'; did you mean 'partition_activations'"),
    ],
)
def test_activation_checkpointing_errors(section: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_section(ActivationCheckpointingConfig, section, path="activation_checkpointing")
