"""The per-node launcher, `python -m ds_launcher.launch`: one worker process per local slot.

The `deepspeed` runner starts this on every node (directly, or through pdsh/ssh) with the job's
world info. It gives each worker the torch/DeepSpeed environment contract, supervises them as one
unit and exits with the job's status. Flags match `deepspeed.launcher.launch`.

Each worker gets: `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_SIZE` (and torchrun's
`LOCAL_WORLD_SIZE`), `CROSS_RANK` (this node's rank), `CROSS_SIZE` (number of nodes),
`MASTER_ADDR`, `MASTER_PORT`, `CUDA_VISIBLE_DEVICES` (this node's slot ids), and `--local_rank=N`
in front of its arguments unless `--no_local_rank`. Global ranks run in node order, then slot order.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ds_launcher._cli_logging import LOG_LEVELS, configure_cli_logging
from ds_launcher._cores import split_cores
from ds_launcher._procs import Supervisor
from ds_launcher._resources import decode_world_info

logger = logging.getLogger("ds_launcher.launch")  # not __name__: this module runs as __main__

#: Seconds between SIGTERM and SIGKILL when the job is being ended.
KILL_GRACE_S = 5.0


def build_parser() -> argparse.ArgumentParser:
    """The flags of `deepspeed.launcher.launch`."""
    p = argparse.ArgumentParser(
        prog="python -m ds_launcher.launch",
        description="Start one worker per local slot of this node and supervise them.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--node_rank", type=int, default=0, help="this node's index in the world info")
    p.add_argument("--master_addr", type=str, default="127.0.0.1", help="rank 0's address")
    p.add_argument("--master_port", type=int, default=29500, help="rank 0's port")
    p.add_argument("--world_info", type=str, default="None", help="base64url JSON {host: [slots]}")
    p.add_argument("--module", action="store_true", help="run the script with `python -m`")
    p.add_argument("--no_python", action="store_true", help="execute the script directly")
    p.add_argument("--no_local_rank", action="store_true", help="do not pass --local_rank=N")
    p.add_argument("--save_pid", type=int, default=0, help="write this launcher's pid to /tmp/<N>.deepspeed")
    p.add_argument("--enable_each_rank_log", type=str, default="None", help="directory for per-rank logs")
    p.add_argument("--bind_cores_to_rank", action="store_true", help="pin each rank to its share of cores")
    p.add_argument("--bind_core_list", type=str, default=None, help="cores to share out, e.g. 0,2-5")
    p.add_argument("--log_level", type=str.lower, default="info", choices=LOG_LEVELS)
    p.add_argument("-q", "--quiet", action="store_true", help="log errors only")
    p.add_argument("training_script", type=str, help="the worker script (or module, or program)")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """How to start one local worker."""

    rank: int
    local_rank: int
    argv: list[str]
    env: dict[str, str]
    log_path: str | None
    cores: list[int] | None


def _worker_argv(args: argparse.Namespace, local_rank: int) -> list[str]:
    if args.no_python and args.module:
        raise ValueError(
            "--no_python and --module cannot be used together: --module runs the script "
            "with `python -m`, --no_python runs it without python"
        )
    prefix = [] if args.no_python else [sys.executable, "-u", *(["-m"] if args.module else [])]
    local = [] if args.no_local_rank else [f"--local_rank={local_rank}"]
    return [*prefix, args.training_script, *local, *args.training_script_args]


def _log_dir(value: str | None) -> str | None:
    if value in (None, "", "None"):
        return None
    assert value is not None
    if os.path.exists(value) and not os.path.isdir(value):
        raise ValueError(f"--enable_each_rank_log {value!r} is a file; pass a directory for the per-rank logs")
    os.makedirs(value, exist_ok=True)
    return value


def plan_ranks(args: argparse.Namespace, environ: Mapping[str, str]) -> list[RankPlan]:
    """Work out every local worker's command line and environment (nothing is started).

    Raises:
        ValueError: bad world info, a node rank outside it, conflicting flags, a log path that is a
            file, or too few cores to bind.
    """
    if args.world_info == "None":
        raise ValueError("--world_info is required (base64url JSON {host: [slots]}, written by `deepspeed`)")
    world = decode_world_info(args.world_info)
    nodes = list(world)
    if not 0 <= args.node_rank < len(nodes):
        raise ValueError(
            f"--node_rank {args.node_rank} is outside the world info's {len(nodes)} node(s) "
            f"({', '.join(nodes)}); use 0..{len(nodes) - 1}"
        )
    slots = world[nodes[args.node_rank]]
    first_rank = sum(len(world[n]) for n in nodes[: args.node_rank])
    num_local = len(slots)
    base = dict(environ)
    base.update(
        MASTER_ADDR=args.master_addr,
        MASTER_PORT=str(args.master_port),
        WORLD_SIZE=str(sum(len(s) for s in world.values())),
        CROSS_RANK=str(args.node_rank),
        CROSS_SIZE=str(len(nodes)),
        LOCAL_SIZE=str(num_local),
        LOCAL_WORLD_SIZE=str(num_local),
        CUDA_VISIBLE_DEVICES=",".join(map(str, slots)),
    )
    cores = split_cores(num_local, args.bind_core_list) if args.bind_cores_to_rank else None
    if cores is None and args.bind_core_list:
        logger.warning("--bind_core_list has no effect without --bind_cores_to_rank")
    if cores is None and "OMP_NUM_THREADS" not in environ and num_local > 1:
        # Like torchrun: N ranks each using every core would oversubscribe the host N times.
        threads = max(1, len(os.sched_getaffinity(0)) // num_local)
        base["OMP_NUM_THREADS"] = str(threads)
        logger.info("OMP_NUM_THREADS not set: using %d per rank (%d ranks on this node)", threads, num_local)
    log_dir = _log_dir(args.enable_each_rank_log)
    stamp = time.strftime("%Y%m%d%H%M%S")
    plans = []
    for local_rank in range(num_local):
        rank = first_rank + local_rank
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(local_rank))
        if cores is not None:
            env["OMP_NUM_THREADS"] = str(len(cores[local_rank]))
        plans.append(
            RankPlan(
                rank=rank,
                local_rank=local_rank,
                argv=_worker_argv(args, local_rank),
                env=env,
                log_path=os.path.join(log_dir, f"{stamp}_rank{rank}.log") if log_dir else None,
                cores=cores[local_rank] if cores is not None else None,
            )
        )
    return plans


def _write_pid_file(save_pid: int) -> str | None:
    if not save_pid:
        return None
    path = f"/tmp/{save_pid}.deepspeed"
    if os.path.exists(path):
        raise ValueError(
            f"--save_pid: {path} already exists (another launch with runner pid {save_pid}?); "
            "remove it if that job is gone"
        )
    with open(path, "w") as f:
        f.write(str(os.getpid()))
    logger.info("launcher pid: %d (written to %s)", os.getpid(), path)
    return path


def run(plans: Sequence[RankPlan], *, grace_s: float = KILL_GRACE_S) -> int:
    """Start every planned worker and supervise them; returns the job's exit status."""
    supervisor = Supervisor(grace_s=grace_s)
    for plan in plans:
        try:
            supervisor.start(f"rank {plan.rank}", plan.argv, env=plan.env, log_path=plan.log_path, affinity=plan.cores)
        except OSError as err:
            logger.error("cannot start rank %d (%s): %s", plan.rank, plan.argv[0], err)
            supervisor.abort()
            return 127 if isinstance(err, FileNotFoundError) else 126  # the shell's "not found"/"not executable"
        logger.info(
            "rank %d (local %d): %s%s",
            plan.rank,
            plan.local_rank,
            shlex.join(plan.argv),
            f" > {plan.log_path}" if plan.log_path else "",
        )
    return supervisor.run()


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m ds_launcher.launch ...`: plan, start and supervise this node's workers."""
    args = build_parser().parse_args(argv)
    configure_cli_logging(args.log_level, quiet=args.quiet, name="ds_launcher.launch")
    try:
        plans = plan_ranks(args, os.environ)
        pid_file = _write_pid_file(args.save_pid)
    except ValueError as err:
        logger.error("%s", err)
        return 2
    try:
        status = run(plans)
    finally:
        if pid_file is not None and os.path.exists(pid_file):
            os.remove(pid_file)
    if status:
        logger.error("job ended with exit status %d", status)
    return status


if __name__ == "__main__":
    sys.exit(main())
