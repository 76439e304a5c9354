"""`pipeline` and `activation_checkpointing`: validated by ds-pipe's own models (an optional extra), lazily.

These sections belong to ds-pipe (`ds_pipe.PipelineConfig`, `ds_pipe.ActivationCheckpointingConfig`);
the top-level model keeps them raw and `DeepSpeedConfig` validates a given section here, at config
time, so a bad value (`pipeline.partition: "bogus"`) is refused with its key path before anything
is built. A config that does not mention them never imports ds-pipe; a config that does, without
ds-pipe installed, is refused with the extra to install.
"""

from __future__ import annotations

from typing import Any

from ds_comm import ConfigError, validate_section
from ds_engine._optional import require
from ds_engine.config._errors import DeepSpeedConfigError

__all__ = ["PIPE_SECTIONS", "pipe_section_model", "validate_pipe_section"]

#: section key -> ds-pipe's model class name
PIPE_SECTIONS = {"pipeline": "PipelineConfig", "activation_checkpointing": "ActivationCheckpointingConfig"}


def pipe_section_model(name: str) -> type[Any]:
    """ds-pipe's model class for section `name`.

    Raises:
        ImportError: ds-pipe is not installed (the message names `pip install 'ds-engine[pipe]'`).
    """
    ds_pipe = require("ds_pipe", extra="pipe", feature=f"the {name!r} config section")
    return getattr(ds_pipe, PIPE_SECTIONS[name])


def validate_pipe_section(name: str, value: dict[str, Any] | None) -> Any:
    """Section `name` validated by ds-pipe's model; None when the config does not have it.

    Raises:
        DeepSpeedConfigError: the section is invalid (each line starts with its key path), or it is
            given and ds-pipe is not installed.
    """
    if value is None:
        return None
    try:
        model = pipe_section_model(name)
    except ImportError as err:
        raise DeepSpeedConfigError(f"{name}: {err}") from None
    try:
        return validate_section(model, value, path=name)
    except ConfigError as err:
        raise DeepSpeedConfigError(str(err).replace("Value error, ", "")) from None
