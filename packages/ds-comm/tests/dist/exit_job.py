"""Started twice (ranks 0 and 1) by test_dist_exit.py: init through ds_comm, collectives, then end as told.

argv[1] picks the ending: `normal` (fall off the end), `raise` (uncaught exception), `stray` (rank 0 leaves
an async all-reduce that rank 1 never joins, then ends normally), `stray-nothread` (the same where Python
refuses to start threads at exit, as 3.12 does), `stray-raise` (the stray all-reduce, then rank 0 raises).
A hook registered before `init_distributed` runs after ds_comm's own exit hook (atexit is last-in,
first-out) and prints whether the default group still exists at that point.
"""

from __future__ import annotations

import atexit
import os
import sys
import time

import torch
import torch.distributed as dist

import ds_comm
import ds_comm._exit_teardown

ending = sys.argv[1]
if ending.startswith("stray"):
    # the stray all-reduce must be gloo's: over the shared-memory pair path (two ranks, one host) nothing of
    # it stays in flight for the teardown to wait on
    os.environ["DS_COMM_SHM"] = "0"
atexit.register(lambda: print(f"after ds_comm's exit hook: initialized={dist.is_initialized()}", flush=True))
ds_comm._exit_teardown.TEARDOWN_LIMIT_S = float(sys.argv[2]) if len(sys.argv) > 2 else 60.0
ds_comm._exit_teardown.EXCEPTION_TEARDOWN_LIMIT_S = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
ds_comm.init_distributed(dist_backend="gloo", verbose=False)
rank = ds_comm.get_rank()
for _ in range(5):
    partial = torch.randn(()).reshape(1)  # a temporary view, dropped right after the call, as in a grad norm
    ds_comm.all_reduce(partial)
    del partial
if ending == "raise":
    raise RuntimeError("the script failed here")
if ending == "stray-nothread":
    import threading

    def _refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    threading.Timer.start = _refuse  # type: ignore[method-assign]
if ending.startswith("stray"):
    if rank == 0:
        ds_comm.all_reduce(torch.ones(4), async_op=True)  # rank 1 never joins it
    else:
        time.sleep(float(sys.argv[3]))
print(f"rank {rank} done", flush=True)
if ending == "stray-raise" and rank == 0:
    raise RuntimeError("the script failed after its stray all-reduce")
