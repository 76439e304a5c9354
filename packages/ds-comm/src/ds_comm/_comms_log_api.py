"""Module-level read-outs of the process's comms logger, under DeepSpeed's `deepspeed.comm` names."""

from __future__ import annotations

from ds_comm._comms_logger import comms_logger

__all__ = ["get_comm_operation_count", "get_logged_comm_ops", "has_comm_data", "reset_log"]


def reset_log() -> None:
    """Forget every record (e.g. after warm-up steps, so the summary covers steady state only)."""
    comms_logger.reset_data()


def has_comm_data() -> bool:
    """Whether this rank has recorded any op."""
    return comms_logger.has_data()


def get_comm_operation_count() -> int:
    """Number of calls this rank has recorded, over all ops and sizes."""
    return comms_logger.get_total_operations()


def get_logged_comm_ops() -> list[str]:
    """The op names this rank has recorded."""
    return comms_logger.get_operation_names()
