"""Worker of the multi-node tests: reports where it runs and what it was given, then trains, fails or hangs.

Every rank prints JSON lines (one `os.write` each, so lines from ranks sharing a pipe do not interleave):
`{"event": "ready", ...}` after the process group formed, with its host name, pid, the ssh connection
it descends from and the variables asked for; then `{"event": "done", ...}` after a few data-parallel
SGD steps on a tiny linear model (gradients averaged with `ds_comm.all_reduce`).
It imports `dsmn_probe` when asked, a module reachable only through the PYTHONPATH the launcher forwards.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import socket
import time

import torch

import ds_comm


def emit(**record: object) -> None:
    os.write(1, (json.dumps(record) + "\n").encode())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--fail_rank",
        type=int,
        default=-1,
        help="this rank raises at --fail_step (0: right after init, while the others sleep)",
    )
    p.add_argument("--fail_step", type=int, default=2)
    p.add_argument("--hang", action="store_true", help="sleep after init until killed")
    p.add_argument("--report_env", nargs="*", default=[])
    p.add_argument("--import_probe", action="store_true", help="import dsmn_probe (found through PYTHONPATH)")
    args = p.parse_args()
    ds_comm.init_distributed(verbose=False)
    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    probe = importlib.import_module("dsmn_probe").VALUE if args.import_probe else None
    emit(
        event="ready",
        rank=rank,
        world=world,
        host=socket.gethostname(),
        pid=os.getpid(),
        t=time.time(),
        ssh=os.environ.get("SSH_CONNECTION"),
        probe=probe,
        env={k: os.environ.get(k) for k in args.report_env},
    )
    if args.hang or (args.fail_rank >= 0 and args.fail_step == 0):
        if rank == args.fail_rank:  # --fail_step 0: fail while the others wait outside any collective
            emit(event="failing", rank=rank, step=0, t=time.time())
            raise RuntimeError(f"injected failure on rank {rank} while the others sleep")
        while True:
            time.sleep(1)
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 1)
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 4, generator=g)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for step in range(1, args.steps + 1):
        if rank == args.fail_rank and step == args.fail_step:
            emit(event="failing", rank=rank, step=step, t=time.time())
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        net.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        for param in net.parameters():
            assert param.grad is not None
            ds_comm.all_reduce(param.grad)
            param.grad /= world
        with torch.no_grad():
            for param in net.parameters():
                param -= 0.05 * param.grad
        losses.append(loss.item())
    emit(event="done", rank=rank, losses=losses)
    ds_comm.destroy_process_group()


if __name__ == "__main__":
    main()
