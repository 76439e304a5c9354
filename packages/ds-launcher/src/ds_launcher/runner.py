"""The `deepspeed` command: choose the resources, then start the job on one host or through a backend.

Order of work (nothing starts until every check has passed):

1. parse and cross-check the flags;
2. read the hostfile (or use this host), apply `--include/--exclude`, `--num_nodes/--num_gpus`;
3. pick the master address;
4. one host (or `--no_ssh`): replace this process with `python -m ds_launcher.launch` for this
   node; several hosts (or `--force_multi`): build the backend's command lines with the forwarded
   environment and supervise them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ds_launcher._args import parse_args
from ds_launcher._cli_logging import configure_cli_logging
from ds_launcher._env import DEFAULT_ENV_FILE, collect_exports, read_env_files
from ds_launcher._hostfile import fetch_hostfile, parse_hostfile
from ds_launcher._mpi_runners import IMPIRunner, MPICHRunner, MVAPICHRunner, OpenMPIRunner
from ds_launcher._procs import Supervisor
from ds_launcher._reachability import SSH_CONNECT_TIMEOUT_S, check_hosts_reachable
from ds_launcher._remote_runners import PDSHRunner, SSHRunner
from ds_launcher._resources import (
    ResourceFilterError,
    apply_num_nodes_and_gpus,
    encode_world_info,
    filter_resources,
    select_slots,
)
from ds_launcher._runner_base import LauncherNotFoundError, LaunchPlan, MultiNodeRunner, launch_command
from ds_launcher._slurm_runner import SlurmRunner

logger = logging.getLogger("ds_launcher.runner")  # not __name__: this module may run as __main__

#: `--launcher` value to runner class.
RUNNERS: dict[str, type[MultiNodeRunner]] = {
    cls.name: cls for cls in (PDSHRunner, OpenMPIRunner, MPICHRunner, IMPIRunner, MVAPICHRunner, SlurmRunner, SSHRunner)
}
_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
#: DeepSpeed's name for the per-job environment file (`.deepspeed_env`); `accelerate launch` writes to it.
DEEPSPEED_ENVIRONMENT_NAME = DEFAULT_ENV_FILE


@dataclass(frozen=True)
class Launch:
    """A checked launch: the plan, whether it goes through a multi-node backend, and the local env."""

    plan: LaunchPlan
    multi_node: bool
    env: dict[str, str]
    """The environment for the local path (the runner's, plus `.deepspeed_env`)."""


def _check_flags(args: argparse.Namespace) -> None:
    if args.elastic_training or args.min_elastic_nodes != -1 or args.max_elastic_nodes != -1:
        raise ValueError(
            "--elastic_training/--min_elastic_nodes/--max_elastic_nodes: elastic training is not "
            "supported by ds-launcher; launch a fixed set of nodes"
        )
    if args.module and args.no_python:
        raise ValueError(
            "--no_python and --module cannot be used together: --module runs the script with "
            "`python -m`, --no_python runs it without python"
        )
    if (args.include or args.exclude) and (args.num_nodes != -1 or args.num_gpus != -1):
        raise ResourceFilterError(
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude; select resources one way or the other"
        )


def local_slot_count(num_gpus: int) -> int:
    """Slots of this host when there is no hostfile: `--num_gpus` when given, else its device count.

    `--num_gpus N` is taken as is (on a CPU host it is the number of CPU ranks), which keeps torch
    out of the runner. Without it, the accelerator decides: the CUDA device count, or 1 CPU rank.
    """
    if num_gpus > 0:
        return num_gpus
    from ds_comm import get_accelerator

    return max(1, get_accelerator().device_count())


def _visible_devices_include(args: argparse.Namespace, env: dict[str, str]) -> str:
    """DeepSpeed's rule: with no hostfile and no filters, CUDA_VISIBLE_DEVICES=a,b means `-i localhost:a,b`."""
    visible = env.pop(_VISIBLE_DEVICES, "")
    if not visible:
        return args.include
    if args.include or args.exclude or args.num_gpus > 0 or args.num_nodes > 1:
        logger.info(
            "ignoring %s=%s: --include/--exclude/--num_gpus/--num_nodes choose the devices", _VISIBLE_DEVICES, visible
        )
        return args.include
    from ds_comm import get_accelerator

    if get_accelerator().name != "cuda":
        logger.info("ignoring %s=%s on a host without CUDA devices", _VISIBLE_DEVICES, visible)
        return args.include
    logger.info("%s=%s: launching with --include localhost:%s", _VISIBLE_DEVICES, visible, visible)
    return f"localhost:{visible}"


def resolve_resources(args: argparse.Namespace, env: dict[str, str]) -> tuple[dict[str, list[int]], bool]:
    """The active resources `{host: [slots]}` and whether they came from a hostfile.

    May remove CUDA_VISIBLE_DEVICES from `env` (it becomes an include filter, as in DeepSpeed).
    """
    pool = fetch_hostfile(args.hostfile)
    include = args.include
    from_hostfile = pool is not None
    if pool is None:
        if args.num_nodes > 1:
            raise ResourceFilterError(
                f"--num_nodes {args.num_nodes} needs a hostfile listing the other nodes; pass --hostfile"
            )
        # Hide the variable from this process before anything asks CUDA (which reads it once): the
        # count must cover every device, since the include it becomes names physical ids.
        saved = os.environ.pop(_VISIBLE_DEVICES, None)
        try:
            include = _visible_devices_include(args, env)
            pool = {"localhost": local_slot_count(args.num_gpus)}
        finally:
            if saved is not None:
                os.environ[_VISIBLE_DEVICES] = saved
    active = filter_resources(pool, include=include, exclude=args.exclude)
    return apply_num_nodes_and_gpus(active, num_nodes=args.num_nodes, num_gpus=args.num_gpus), from_hostfile


def is_local_host(host: str) -> bool:
    """Whether `host` names this machine (by loopback name/address or this host's own name)."""
    return host in {"localhost", "::1", socket.gethostname(), socket.getfqdn()} or host.startswith("127.")


def is_this_host(host: str) -> bool:
    """`is_local_host`, or `host` resolves to an address of this machine (one a socket can bind to).

    Settles whether a job on one host can run here without ssh: a hostfile may name this machine by
    an address or an alias that `is_local_host` does not know.
    """
    if is_local_host(host):
        return True
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False
    for family, _, _, _, address in infos:
        try:
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((address[0], 0))
            return True
        except OSError:
            continue
    return False


def _first_address(argv: list[str], what: str) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(f"could not find the master address ({what} failed: {err}); pass --master_addr") from None
    if not out:
        raise RuntimeError(f"could not find the master address ({what} printed nothing); pass --master_addr")
    return out[0]


def resolve_master_addr(args: argparse.Namespace, hosts: Sequence[str], multi_node: bool) -> str:
    """`--master_addr`, else: 127.0.0.1 when every host is this one; else the first host's address."""
    if args.master_addr:
        return args.master_addr
    if all(is_local_host(h) for h in hosts):
        return "127.0.0.1"
    first = hosts[0]
    if is_local_host(first):
        return _first_address(["hostname", "-I"], "hostname -I")
    if not multi_node:  # --no_ssh: the name of node 0 is the best we know without ssh
        return first
    port = ["-p", str(args.ssh_port)] if args.ssh_port else []
    ssh = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={SSH_CONNECT_TIMEOUT_S}", *port]
    return _first_address([*ssh, first, "hostname", "-I"], f"ssh {first} hostname -I")


def build_plan(args: argparse.Namespace, active: dict[str, list[int]], *, master_addr: str, cwd: str) -> LaunchPlan:
    """The launch plan for `active` resources from parsed `deepspeed` flags (no checks, nothing started)."""
    return LaunchPlan(
        active=active,
        world_info=encode_world_info(active),
        master_addr=master_addr,
        master_port=args.master_port,
        user_script=args.user_script,
        user_args=tuple(args.user_args),
        cwd=cwd,
        module=args.module,
        no_python=args.no_python,
        no_local_rank=args.no_local_rank,
        save_pid=os.getpid() if args.save_pid else 0,
        enable_each_rank_log=None if args.enable_each_rank_log in ("", "None") else args.enable_each_rank_log,
        bind_cores_to_rank=args.bind_cores_to_rank,
        bind_core_list=args.bind_core_list,
        launcher_args=tuple(shlex.split(args.launcher_args)),
        ssh_port=args.ssh_port,
        venv_script=args.venv_script,
        log_level=args.log_level,
        quiet=args.quiet,
        filtered=bool(args.include or args.exclude),
        num_nodes=args.num_nodes,
        num_gpus=args.num_gpus,
        slurm_comment=args.slurm_comment,
    )


def plan_launch(args: argparse.Namespace, environ: Mapping[str, str], *, cwd: str, home: str) -> Launch:
    """Check everything and decide how to launch; starts nothing.

    Raises:
        ValueError: bad flags, hostfile, filters, `.deepspeed_env`, or a selection the backend cannot run.
        RuntimeError: the master address could not be found.
    """
    _check_flags(args)
    env = dict(environ)
    active, _ = resolve_resources(args, env)
    if args.no_ssh and not 0 <= args.node_rank < len(active):
        raise ValueError(
            f"--no_ssh needs --node_rank in 0..{len(active) - 1} (this node's index among "
            f"{', '.join(active)}), got {args.node_rank}"
        )
    if args.node_rank != -1 and not args.no_ssh:
        logger.warning("--node_rank has no effect without --no_ssh")
    # One host that is not this one (`--include worker-1`) also goes through the backend: started
    # here, its ranks would wait for a master on the other host that nothing starts.
    multi_node = (args.force_multi or len(active) > 1 or not is_this_host(next(iter(active)))) and not args.no_ssh
    RUNNERS[args.launcher].validate_active_resources(active)
    plan = build_plan(args, active, master_addr=resolve_master_addr(args, list(active), multi_node), cwd=cwd)
    if not multi_node:
        env.update(read_env_files(environ, cwd=cwd, home=home))
    return Launch(plan, multi_node, env)


def _check_ssh(args: argparse.Namespace, plan: LaunchPlan) -> None:
    """Every remote host must answer passwordless ssh before anything starts (not under SLURM, which uses no ssh)."""
    if args.no_ssh_check or args.launcher == "slurm":
        return
    check_hosts_reachable(plan.hosts, args.ssh_port, is_local=is_local_host)


def run_multi_node(args: argparse.Namespace, launch: Launch, environ: Mapping[str, str], *, home: str) -> int:
    """Start the backend's processes with the forwarded environment and supervise them."""
    plan = launch.plan
    runner = RUNNERS[args.launcher](plan)
    _check_ssh(args, plan)
    runner.check_backend()
    exports = collect_exports(environ, cwd=plan.cwd, home=home)
    commands = runner.commands(exports)

    def stop_remote() -> None:
        kill_env = {**launch.env, **runner.kill_env()}
        for argv in runner.kill_commands():
            logger.info("stopping remote launchers: %s", shlex.join(argv))
            subprocess.run(argv, capture_output=True, timeout=30, check=False, env=kill_env)

    supervisor = Supervisor(on_terminate=stop_remote)
    for command in commands:
        logger.info("%s: %s", command.name, shlex.join(command.argv))
        supervisor.start(
            command.name,
            command.argv,
            env={**launch.env, **command.env},
            cwd=plan.cwd,
            stderr_watch=command.stderr_watch,
        )
    return supervisor.run()


def _exec_local(launch: Launch, node_rank: int) -> None:
    argv = launch_command(launch.plan, node_rank)
    logger.info("cmd = %s", shlex.join(argv))
    for handler in logging.getLogger("ds_launcher").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(argv[0], argv, launch.env)


def parse_resource_filter(
    host_info: Mapping[str, Sequence[int]], include_str: str = "", exclude_str: str = ""
) -> dict[str, list[int]]:
    """DeepSpeed's name and signature for `--include/--exclude` on `{host: [slot ids]}`.

    Unlike the launch path (`filter_resources`), excluding everything gives `{}` rather than an
    error: callers of DeepSpeed's function test the result themselves.

    Raises:
        ValueError: both filters given, an unknown host or slot, or a malformed spec.
    """
    return select_slots(
        {host: list(slots) for host, slots in host_info.items()}, include=include_str, exclude=exclude_str
    )


def _parse_hostfile(hostfile_lines: Sequence[str]) -> dict[str, int]:
    """DeepSpeed's hostfile parser over a list of lines: `{host: slots}` in file order.

    Raises:
        ValueError: a malformed line, a host listed twice, or no hosts (see `parse_hostfile`).
    """
    return parse_hostfile("\n".join(hostfile_lines))


def main(args: Sequence[str] | None = None) -> int:
    """Run the `deepspeed` command with `args` (default `sys.argv[1:]`); DeepSpeed's programmatic entry.

    With `--autotuning tune|run` it runs the autotuner instead (`ds_launcher.autotuning`): experiments
    launched one at a time through this command, then (`run`) training with the best config.

    Returns the job's exit status. Bad input is raised, as DeepSpeed's `main` does, so a caller
    can catch it; the console script (`cli`) reports it as one line and exit status 2 instead.

    Raises:
        ValueError: bad flags, hostfile, filters or `.deepspeed_env`.
        RuntimeError: the master address could not be found, or the backend tool is missing.
    """
    parsed = parse_args(args)
    configure_cli_logging(parsed.log_level, quiet=parsed.quiet, name="deepspeed")
    cwd, home = os.getcwd(), os.path.expanduser("~")
    if parsed.autotuning:
        _check_flags(parsed)
        active, _ = resolve_resources(parsed, dict(os.environ))
        # Imported here: the autotuner reads configs through ds-comm, which imports torch (seconds), and
        # every plain launch, each autotuning experiment included, goes through this module.
        from ds_launcher._autotuning.autotuner import run_autotuning

        return run_autotuning(parsed, active)
    launch = plan_launch(parsed, os.environ, cwd=cwd, home=home)
    if not launch.multi_node:
        _exec_local(launch, max(parsed.node_rank, 0) if parsed.no_ssh else 0)
    status = run_multi_node(parsed, launch, os.environ, home=home)
    if status:
        logger.error("job ended with exit status %d", status)
    return status


def cli(argv: Sequence[str] | None = None) -> int:
    """The `deepspeed` console script (and `python -m ds_launcher`): `main`, with errors as exit status 2."""
    try:
        return main(argv)
    except (ValueError, RuntimeError) as err:
        kind = "not installed" if isinstance(err, LauncherNotFoundError) else "error"
        logging.getLogger("ds_launcher.runner").error("%s: %s", kind, err)
        return 2


if __name__ == "__main__":
    sys.exit(cli())
