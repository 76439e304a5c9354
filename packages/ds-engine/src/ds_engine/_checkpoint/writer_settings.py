"""The `checkpoint` section as DeepSpeed's code reads it: plain dicts keyed by its constants.

DeepSpeed's `model_checkpointing.config` turns the section into dicts (`get_checkpoint_config`,
`get_checkpoint_writer_config`) that its writer factory and checkpoint engines take. Here the section is
validated by ds's `CheckpointConfig` first, so a bad value is an error naming its key path, and the dicts
are built from the validated values. One difference: `writer.type: MOCK` is accepted here, because the
writer factory makes real `MockFileWriter`s from it; an engine config still refuses it (its checkpoint
would be published empty).
"""

from __future__ import annotations

import copy
from typing import Any

from ds_comm import validate_section
from ds_engine._checkpoint import writer_constants as c

__all__ = ["CHECKPOINT_DEFAULT_DICT", "VALID_VALUES", "get_checkpoint_config", "get_checkpoint_writer_config"]

VALID_VALUES = {
    c.CHECKPOINT_TAG_VALIDATION: c.CHECKPOINT_TAG_VALIDATION_MODES,
    c.CHECKPOINT_WRITER_TYPE: c.CHECKPOINT_WRITER_TYPES,
    c.CHECKPOINT_DATA_PARALLEL: c.CHECKPOINT_DATA_PARALLEL_UNITS,
}
"""The values each key may take (DeepSpeed's table)."""

CHECKPOINT_DEFAULT_DICT = {
    c.CHECKPOINT_TAG_VALIDATION: c.CHECKPOINT_TAG_VALIDATION_DEFAULT,
    c.CHECKPOINT_SERIALIZATION: c.CHECKPOINT_SERIALIZATION_DEFAULT,
    c.CHECKPOINT_WRITER: c.CHECKPOINT_WRITER_DEFAULT,
}
"""What `get_checkpoint_config` returns for a config without a `checkpoint` section."""


def _validated_checkpoint(section: dict[str, Any]) -> tuple[Any, bool]:
    """ds's `CheckpointConfig` of `section`, and whether its writer type was MOCK (validated as PYTHON)."""
    from ds_engine.config import CheckpointConfig  # noqa: PLC0415 - pydantic loads on first use

    section = copy.deepcopy(section)
    writer = section.get(c.CHECKPOINT_WRITER)
    mock = isinstance(writer, dict) and str(writer.get(c.CHECKPOINT_WRITER_TYPE, "")).upper() == "MOCK"
    if mock and isinstance(writer, dict):
        writer[c.CHECKPOINT_WRITER_TYPE] = "PYTHON"
    return validate_section(CheckpointConfig, section, path=c.CHECKPOINT), mock


def _writer_dict(writer: Any, mock: bool) -> dict[str, Any]:
    return {
        c.CHECKPOINT_WRITER_TYPE: c.CheckpointWriterType.MOCK if mock else writer.type,
        c.CHECKPOINT_IO_BUFFER_SIZE: writer.io_buffer_size,
        c.CHECKPOINT_IO_BUFFER_DOUBLE: writer.io_buffer_double,
        c.CHECKPOINT_IO_STATISTICS: writer.show_statistics,
        c.CHECKPOINT_DATA_PARALLEL: writer.data_parallel,
        c.CHECKPOINT_WRITER_DECOUPLED: writer.decoupled,
        c.CHECKPOINT_IO_MULTIPLIER: writer.io_multiplier,
    }


def get_checkpoint_writer_config(param_dict: dict[str, Any]) -> dict[str, Any] | None:
    """The `writer` entry of the `checkpoint` section `param_dict` as DeepSpeed's dict; None without one.

    Raises:
        ConfigError: a bad value, naming `checkpoint.writer.<key>`.
    """
    if param_dict.get(c.CHECKPOINT_WRITER) is None:
        return c.CHECKPOINT_WRITER_DEFAULT
    section, mock = _validated_checkpoint({c.CHECKPOINT_WRITER: param_dict[c.CHECKPOINT_WRITER]})
    return _writer_dict(section.writer, mock)


def get_checkpoint_config(param_dict: dict[str, Any]) -> dict[str, Any]:
    """The whole config's `checkpoint` section as DeepSpeed's dict (tag validation, serialization, writer).

    Raises:
        ConfigError: a bad value, naming `checkpoint.<key>`.
    """
    raw = param_dict.get(c.CHECKPOINT)
    if raw is None:
        return dict(CHECKPOINT_DEFAULT_DICT)
    section, mock = _validated_checkpoint(raw)
    return {
        c.CHECKPOINT_TAG_VALIDATION: section.tag_validation,
        c.CHECKPOINT_SERIALIZATION: section.checkpoint_serialization,
        c.CHECKPOINT_WRITER: None if section.writer is None else _writer_dict(section.writer, mock),
    }
