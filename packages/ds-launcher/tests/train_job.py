"""Worker for the launcher's real-run tests: a tiny linear model trained data-parallel with torch + ds_comm.

Each rank trains on its own shard and averages gradients with `ds_comm.all_reduce`; it also trains
a plain single-process reference on all shards and reports both, so a test can check that the
launched job really formed one process group of the expected size. Prints JSON lines:
`{"event": "ready", ...}` after init and `{"event": "done", ...}` at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

import ds_comm

CONTRACT = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_SIZE",
    "LOCAL_WORLD_SIZE",
    "CROSS_RANK",
    "CROSS_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "CUDA_VISIBLE_DEVICES",
    "OMP_NUM_THREADS",
)


def emit(**record: object) -> None:
    # One write() per line: ranks share the launcher's stdout pipe, and print(flush=True) under
    # PYTHONUNBUFFERED writes the text and the newline separately, so two ranks' lines could interleave.
    os.write(1, (json.dumps(record) + "\n").encode())


def shard(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(8, 4, generator=g)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(8, 1, generator=g)


def model() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 1)


def train(args: argparse.Namespace, rank: int, world: int) -> tuple[list[float], torch.nn.Linear]:
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    x, y = shard(rank)
    losses = []
    for step in range(1, args.steps + 1):
        if rank == args.fail_rank and step == args.fail_step:
            emit(event="failing", rank=rank, step=step, t=time.time())
            raise RuntimeError(f"injected failure on rank {rank} at step {step}")
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        for p in net.parameters():
            assert p.grad is not None
            ds_comm.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        losses.append(loss.item())
    return losses, net


def reference(args: argparse.Namespace, world: int) -> torch.nn.Linear:
    """Full-batch single-process training on every shard: what data parallelism must reproduce."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    x = torch.cat([shard(r)[0] for r in range(world)])
    y = torch.cat([shard(r)[1] for r in range(world)])
    for _ in range(args.steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()
    return net


def flat(net: torch.nn.Module) -> list[float]:
    return torch.cat([p.detach().flatten() for p in net.parameters()]).tolist()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--fail_rank", type=int, default=-1)
    p.add_argument("--fail_step", type=int, default=-1)
    p.add_argument("--hang", action="store_true", help="sleep forever after init (signal tests)")
    p.add_argument("--spawn_child", action="store_true", help="start a detached `sleep` grandchild")
    p.add_argument("--report_env", nargs="*", default=[], help="extra env vars to report")
    p.add_argument("--echo", nargs="*", default=[], help="arguments to report back verbatim")
    args = p.parse_args()
    env = {k: os.environ.get(k) for k in (*CONTRACT, *args.report_env)}
    ds_comm.init_distributed(verbose=False)
    rank, world = ds_comm.get_rank(), ds_comm.get_world_size()
    child = subprocess.Popen(["sleep", "300"], start_new_session=True).pid if args.spawn_child else None
    emit(event="ready", rank=rank, pid=os.getpid(), child_pid=child)
    if args.hang:
        while True:
            time.sleep(1)
    losses, net = train(args, rank, world)
    emit(
        event="done",
        rank=rank,
        world=world,
        local_rank=ds_comm.get_local_rank(),
        arg_local_rank=args.local_rank,
        env=env,
        echo=args.echo,
        argv=sys.argv[1:],
        losses=losses,
        params=flat(net),
        ref_params=flat(reference(args, world)),
    )
    ds_comm.destroy_process_group()


if __name__ == "__main__":
    main()
