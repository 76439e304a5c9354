"""`deepspeed.utils.comms_logging`: the comms logger class, which is ds-comm's `CommsLogger`.

`CommsLogger()` has DeepSpeed's switches, records and read-outs (`start_profiling_comms`, `prof_all`,
`comms_dict`, `get_raw_data`, `get_operation_summary`, `log_all`, ...); `comms_logger` is the process's
instance that the collectives feed. Records are kept in DeepSpeed's layout (per op and message size: the
count and parallel lists of latency, algbw and busbw, the lists capped at the most recent
`ds_comm.DEFAULT_MAX_SAMPLES` calls), and summaries are DeepSpeed's 10%-trimmed means over them.
"""

from __future__ import annotations

from ds_comm import CommsLogger, comms_logger

__all__ = ["CommsLogger", "comms_logger"]
