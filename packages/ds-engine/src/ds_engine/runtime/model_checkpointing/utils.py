"""`deepspeed.runtime.model_checkpointing.utils`: the process layout the writer decision reads.

Re-exports `ds_engine._checkpoint.dp_writer_config`.
"""

from __future__ import annotations

from ds_engine._checkpoint.dp_writer_config import (
    SOCKETS_PER_MACHINE,
    ExpertParallelInfo,
    MPUInfo,
    UniversalParallelInfo,
    create_data_parallel_writer_config,
    create_universal_parallel_info,
)

__all__ = [
    "SOCKETS_PER_MACHINE",
    "ExpertParallelInfo",
    "MPUInfo",
    "UniversalParallelInfo",
    "create_data_parallel_writer_config",
    "create_universal_parallel_info",
]
