"""What every multi-node runner shares: the launch plan, the runner interface, the per-node launch command."""

from __future__ import annotations

import abc
import re
import shlex
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar


class LauncherNotFoundError(RuntimeError):
    """The backend tool (pdsh, mpirun, srun, ssh) is not on PATH; the message says which package has it."""


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """Everything decided about a launch before any process starts (built by `ds_launcher.runner`)."""

    active: dict[str, list[int]]
    """`{host: [slot ids]}` in hostfile order: the resources this job runs on."""
    world_info: str
    """`active` as base64url JSON (`encode_world_info`)."""
    master_addr: str
    master_port: int
    user_script: str
    user_args: tuple[str, ...] = ()
    cwd: str
    python: str = field(default_factory=lambda: sys.executable)
    module: bool = False
    no_python: bool = False
    no_local_rank: bool = False
    save_pid: int = 0
    enable_each_rank_log: str | None = None
    bind_cores_to_rank: bool = False
    bind_core_list: str | None = None
    launcher_args: tuple[str, ...] = ()
    ssh_port: int | None = None
    venv_script: str | None = None
    log_level: str = "info"
    quiet: bool = False
    filtered: bool = False
    """Whether `--include/--exclude` selected the resources."""
    num_nodes: int = -1
    num_gpus: int = -1
    slurm_comment: str = ""

    @property
    def hosts(self) -> list[str]:
        return list(self.active)

    @property
    def world_size(self) -> int:
        return sum(len(slots) for slots in self.active.values())


@dataclass(frozen=True)
class Command:
    """One process the runner starts: its argv and the variables added to the runner's environment."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    stderr_watch: Callable[[str], int | None] | None = None
    """Reads each stderr line; a non-zero result fails the job with that status (see `Supervisor.start`)."""


def launch_command(plan: LaunchPlan, node_rank: int | str) -> list[str]:
    """`python -u -m ds_launcher.launch ... script args` for one node (`node_rank` may be pdsh's `%n`)."""
    argv = [
        plan.python,
        "-u",
        "-m",
        "ds_launcher.launch",
        f"--world_info={plan.world_info}",
        f"--node_rank={node_rank}",
        f"--master_addr={plan.master_addr}",
        f"--master_port={plan.master_port}",
    ]
    argv += ["--module"] * plan.module + ["--no_python"] * plan.no_python + ["--no_local_rank"] * plan.no_local_rank
    if plan.save_pid:
        argv += ["--save_pid", str(plan.save_pid)]
    if plan.enable_each_rank_log:
        argv.append(f"--enable_each_rank_log={plan.enable_each_rank_log}")
    if plan.bind_cores_to_rank:
        argv.append("--bind_cores_to_rank")
    if plan.bind_core_list:
        argv.append(f"--bind_core_list={plan.bind_core_list}")
    argv.append(f"--log_level={plan.log_level}")
    if plan.quiet:
        argv.append("--quiet")
    return [*argv, plan.user_script, *plan.user_args]


def python_command(plan: LaunchPlan) -> list[str]:
    """The worker command MPI and srun start directly: `python -u [-m] script args` (or the program)."""
    if plan.no_python:
        return [plan.user_script, *plan.user_args]
    return [plan.python, "-u", *(["-m"] if plan.module else []), plan.user_script, *plan.user_args]


def launch_pattern(plan: LaunchPlan) -> str:
    """An extended regex matching this job's node launchers (and no one else's) for `pkill -f`.

    [Note] Written with `\\.` and `[0-9]`, it cannot match the command line of the shell that runs
    pkill, which holds the pattern's own text.
    """

    def ere(text: str) -> str:
        return re.sub(r"([.\[\]()*+?{}|^$\\])", r"\\\1", text)

    return (
        f"ds_launcher\\.launch --world_info={ere(plan.world_info)} --node_rank=[0-9]+ "
        f"--master_addr={ere(plan.master_addr)} --master_port={plan.master_port}"
    )


def remote_shell_command(plan: LaunchPlan, exports: dict[str, str], node_rank: int | str) -> str:
    """The one-line shell command a node runs: [venv], cd, export the variables, exec the node launcher.

    Every word is quoted with `shlex.quote`, so values with spaces, quotes or `$` arrive unchanged.
    """
    parts = []
    if plan.venv_script:
        parts.append(f". {shlex.quote(plan.venv_script)}")
    parts.append(f"cd {shlex.quote(plan.cwd)}")
    if exports:
        parts.append("export " + " ".join(f"{key}={shlex.quote(value)}" for key, value in exports.items()))
    parts.append("exec " + shlex.join(launch_command(plan, node_rank)))
    return " && ".join(parts)


def require_prefix_slots(name: str, active: dict[str, list[int]]) -> None:
    """Backends that start N ranks per host cannot pick device ids: every host must use slots 0..n-1."""
    for host, slots in active.items():
        if slots != list(range(len(slots))):
            raise ValueError(
                f"--launcher {name} cannot select specific device ids, got {slots} on {host!r}; "
                "filter whole hosts, or keep the first N slots on every host (--num_gpus N)"
            )


def require_equal_slots(name: str, active: dict[str, list[int]]) -> None:
    """Backends with a single processes-per-node count need the same slot count everywhere."""
    counts = {host: len(slots) for host, slots in active.items()}
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"--launcher {name} needs the same slot count on every host, got {counts}; "
            "use --num_gpus N to take the first N slots of each host"
        )


class MultiNodeRunner(abc.ABC):
    """A backend that starts the job on several hosts.

    Subclasses set `name` (the `--launcher` value), `tool` (the executable that must be on PATH)
    and `provider` (what to install to get it), and build the command lines.
    """

    name: ClassVar[str]
    tool: ClassVar[str]
    provider: ClassVar[str]

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan

    def backend_exists(self) -> bool:
        """Whether the backend's tool is on PATH."""
        return shutil.which(self.tool) is not None

    def check_backend(self) -> None:
        """Raises `LauncherNotFoundError` naming the tool and the package that provides it."""
        if not self.backend_exists():
            raise LauncherNotFoundError(
                f"--launcher {self.name} needs `{self.tool}`, which is not on PATH; install {self.provider}"
            )

    @classmethod
    def validate_active_resources(cls, active: dict[str, list[int]]) -> None:
        """Reject resource selections this backend cannot honour (ValueError); default: all are fine."""
        return None

    @abc.abstractmethod
    def commands(self, exports: dict[str, str]) -> list[Command]:
        """The processes to start, given the variables to forward to every worker."""

    def kill_commands(self) -> list[list[str]]:
        """Commands that stop the job's remote processes when the runner is interrupted."""
        return []

    def kill_env(self) -> dict[str, str]:
        """Variables `kill_commands` need on top of the runner's environment (pdsh's remote shell and port)."""
        return {}
