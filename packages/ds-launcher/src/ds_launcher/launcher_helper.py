"""`python -m ds_launcher.launcher_helper`: under an MPICH `mpirun`, set RANK/LOCAL_RANK and exec the worker.

MPICH's Hydra gives each rank `PMI_RANK` (or `PMIX_RANK`) and `MPI_LOCALRANKID` (Cray PALS:
`PALS_LOCAL_RANKID`). The torch contract wants RANK and LOCAL_RANK, so this maps one to the other,
checks that the two sources agree when both are present, and replaces itself with the worker.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence

_RANK_SOURCES = ("PMI_RANK", "PMIX_RANK")
_LOCAL_RANK_SOURCES = ("MPI_LOCALRANKID", "PALS_LOCAL_RANKID")
SUPPORTED = ("mpich",)


def _one_of(env: Mapping[str, str], names: Sequence[str], what: str) -> str:
    values = {name: env[name] for name in names if env.get(name, "") != ""}
    if not values:
        raise OSError(f"{what}: none of {', '.join(names)} is set; this helper must be started by MPICH's mpirun")
    if len(set(values.values())) > 1:
        raise OSError(f"{what}: the MPI variables disagree: {values}")
    return next(iter(values.values()))


def mpi_rank_env(env: Mapping[str, str]) -> dict[str, str]:
    """`{"RANK": ..., "LOCAL_RANK": ...}` from the MPI launcher's variables.

    Raises:
        OSError: a value is missing, or two sources disagree.
    """
    return {"RANK": _one_of(env, _RANK_SOURCES, "RANK"), "LOCAL_RANK": _one_of(env, _LOCAL_RANK_SOURCES, "LOCAL_RANK")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m ds_launcher.launcher_helper")
    p.add_argument("--launcher", type=str.lower, required=True, help="the MPI flavour that started us")
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("user_script")
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    return p


def worker_argv(args: argparse.Namespace, local_rank: str) -> list[str]:
    """The command this helper execs: `python -u [-m] script [--local_rank=N] args`."""
    if args.module and args.no_python:
        raise ValueError("--no_python and --module cannot be used together")
    prefix = [] if args.no_python else [sys.executable, "-u", *(["-m"] if args.module else [])]
    local = [] if args.no_local_rank else [f"--local_rank={local_rank}"]
    return [*prefix, args.user_script, *local, *args.user_args]


def main(argv: Sequence[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.launcher not in SUPPORTED:
        raise NotImplementedError(f"launcher_helper supports --launcher {', '.join(SUPPORTED)}, got {args.launcher!r}")
    ranks = mpi_rank_env(os.environ)
    os.environ.update(ranks)
    command = worker_argv(args, ranks["LOCAL_RANK"])
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
