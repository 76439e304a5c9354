"""`deepspeed.utils.comms_logging`: the comms logger class, which is ds-comm's `CommsLogger`.

`CommsLogger()` has DeepSpeed's switches and read-outs (`start_profiling_comms`, `prof_all`,
`get_operation_summary`, ...); `comms_logger` is the process's instance that the collectives feed.
ds-comm keeps running sums per (op, message size) where DeepSpeed keeps every call's latency in
`comms_dict`, so summaries are plain means over the recorded calls, not DeepSpeed's 10%-trimmed ones.
"""

from __future__ import annotations

from ds_comm import CommsLogger, comms_logger

__all__ = ["CommsLogger", "comms_logger"]
