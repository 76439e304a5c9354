"""How a framework job's rank ends: leave the process group within a bound, then exit without finalization.

Two ways a finished 2-rank gloo job has been seen to fail here at exit, both after its results were
written: gloo's worker threads abort a process that is finalizing the interpreter ("terminate called
without an active exception", see `ds_comm._exit_teardown`), and `destroy_process_group()` waiting
forever on one rank once its peer had already gone (Fabric's DDP, on a loaded host). So the rank
destroys its groups on a separate thread, waits at most `timeout_s`, and leaves with `os._exit`: no
interpreter finalization for the gloo threads to trip over, and no hang.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import NoReturn

import torch.distributed as dist


def leave(timeout_s: float = 30.0) -> NoReturn:
    """Barrier, destroy the process groups (bounded by `timeout_s`), flush, and `os._exit(0)`."""
    if dist.is_initialized():
        dist.barrier()
        done = threading.Thread(target=dist.destroy_process_group, daemon=True)
        done.start()
        done.join(timeout_s)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
