"""Started by `mpirun -n 2` in test_dist_mpi.py: discover the layout through MPI, then all-reduce."""

from __future__ import annotations

import json
import os
import sys

import torch

import ds_comm

port = int(sys.argv[1])
assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ, "the test must not set torch env vars"
ds_comm.init_distributed(distributed_port=port, verbose=False)
t = torch.tensor([float(ds_comm.get_rank() + 1)])
ds_comm.all_reduce(t)
print(
    json.dumps(
        {
            "rank": ds_comm.get_rank(),
            "world": ds_comm.get_world_size(),
            "local_rank": ds_comm.get_local_rank(),
            "sum": t.item(),
        }
    ),
    flush=True,
)
ds_comm.destroy_process_group()
