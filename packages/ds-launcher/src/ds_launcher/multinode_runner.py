"""DeepSpeed's `deepspeed.launcher.multinode_runner` API over ds-launcher's own runners.

DeepSpeed's runners are built from the parsed `deepspeed` flags and the base64 world info, collect
exports with `add_export`, and hand back a command from `get_cmd(environment, active_resources)`.
ds-launcher's runners (`_remote_runners`, `_mpi_runners`, `_slurm_runner`) take a `LaunchPlan`
instead. The classes here translate one into the other, so code written against DeepSpeed's
classes builds the same command lines the `deepspeed` command starts.

Differences kept from ds-launcher (see the README): the MPI runners size `-n` from the active
resources, and values reach the workers through `shlex.quote` (`exports` shows DeepSpeed's
double-quoted form, but the command is built from the raw values).
"""

from __future__ import annotations

import abc
import argparse
import base64
import binascii
import json
import os
import re
from collections.abc import Mapping, MutableMapping, Sequence
from typing import Any, ClassVar

from ds_launcher import _mpi_runners, _remote_runners, _slurm_runner
from ds_launcher._runner_base import Command
from ds_launcher._runner_base import MultiNodeRunner as _DsRunner
from ds_launcher.runner import build_plan

__all__ = [
    "MVAPICHRunner",
    "MPICHRunner",
    "IMPIRunner",
    "MultiNodeRunner",
    "OpenMPIRunner",
    "PDSHRunner",
    "SlurmRunner",
]

#: Characters a value may hold without DeepSpeed wrapping it in double quotes in `exports`.
_PLAIN_VALUE = re.compile(r"[\w@%+=:,./-]*")

Resources = Mapping[str, "int | Sequence[int]"]


def _slot_lists(resources: Resources) -> dict[str, list[int]]:
    """`{host: [slot ids]}`; a bare count `n` (a resource pool entry) means slots `0..n-1`."""
    out: dict[str, list[int]] = {}
    for host, slots in resources.items():
        out[host] = list(range(slots)) if isinstance(slots, int) else [int(s) for s in slots]
    return out


def _decode_world_info(world_info_base64: str) -> dict[str, list[int]]:
    try:
        value = json.loads(base64.urlsafe_b64decode(world_info_base64.encode("ascii")))
    except (binascii.Error, UnicodeError, ValueError):
        raise ValueError(
            f"world_info_base64 {world_info_base64!r} is not base64url-encoded JSON; build it with "
            "deepspeed.launcher.runner.encode_world_info"
        ) from None
    if not isinstance(value, dict):
        raise ValueError(f"world_info_base64 decodes to {value!r}; expected a {{host: slots}} map")
    return _slot_lists(value)


class MultiNodeRunner(abc.ABC):
    """DeepSpeed's runner interface: `args` (the parsed flags), the world info, and the exports.

    `add_export(key, value)` records a variable for every worker; `exports` holds it as DeepSpeed
    shows it (double-quoted when it holds a character outside `[A-Za-z0-9_@%+=:,./-]`).
    """

    def __init__(self, args: Any, world_info_base64: str) -> None:
        self.args = args
        self.validate_args()
        self.user_arguments = self.parse_user_args()
        self.user_script = args.user_script
        self.world_info_base64 = world_info_base64
        self.exports: dict[str, str] = {}
        self._raw_exports: dict[str, str] = {}

    @abc.abstractmethod
    def backend_exists(self) -> bool:
        """Whether the backend's tool is installed."""

    @abc.abstractmethod
    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> Any:
        """The command that starts the job on `active_resources`."""

    def add_export(self, key: str, var: str) -> None:
        """Forward `key=var` to every worker (both are stripped of surrounding whitespace)."""
        key, var = key.strip(), var.strip()
        self._raw_exports[key] = var
        self.exports[key] = var if _PLAIN_VALUE.fullmatch(var) else f'"{var}"'

    def parse_user_args(self) -> list[str]:
        """The user script's arguments (ds-launcher quotes them itself when a shell is involved)."""
        return list(self.args.user_args)

    @property
    def name(self) -> str:
        """The backend's name (the class name for runners defined outside ds-launcher)."""
        return type(self).__name__

    def validate_args(self) -> None:
        """Reject flags this backend cannot honour (ValueError); default: all are accepted."""
        return None


class _Adapter(MultiNodeRunner):
    """A DeepSpeed-style runner backed by one of ds-launcher's runner classes."""

    _ds: ClassVar[type[_DsRunner]]

    @property
    def name(self) -> str:
        return self._ds.name

    def _runner(self, active_resources: Resources) -> _DsRunner:
        args: argparse.Namespace = self.args
        active = _slot_lists(active_resources)
        if not active:
            raise ValueError(f"{self.name}: active_resources is empty; nothing to launch")
        self._ds.validate_active_resources(active)
        # DeepSpeed's runner fills args.master_addr before building the runner; without it the
        # first host is the best guess that needs no remote call.
        master_addr = args.master_addr or next(iter(active))
        plan = build_plan(args, active, master_addr=master_addr, cwd=os.getcwd())
        return self._make(plan)

    def _make(self, plan: Any) -> _DsRunner:
        return self._ds(plan)

    def _command(self, environment: MutableMapping[str, str], active_resources: Resources) -> tuple[_DsRunner, Command]:
        runner = self._runner(active_resources)
        (command,) = runner.commands(dict(self._raw_exports))
        environment.update(command.env)
        return runner, command

    def backend_exists(self) -> bool:
        return self._make(_placeholder_plan(self)).backend_exists()


def _placeholder_plan(adapter: _Adapter) -> Any:
    """A plan over the world info's resources, for questions that do not depend on the job (is the tool there?)."""
    active = _decode_world_info(adapter.world_info_base64)
    return build_plan(adapter.args, active, master_addr=adapter.args.master_addr or "127.0.0.1", cwd=os.getcwd())


class PDSHRunner(_Adapter):
    """pdsh: `get_cmd` returns `(cmd, kill_cmd, environment)`; `environment` gains `PDSH_RCMD_TYPE=ssh`."""

    _ds = _remote_runners.PDSHRunner

    def get_cmd(
        self, environment: MutableMapping[str, str], active_resources: Resources
    ) -> tuple[list[str], list[str], MutableMapping[str, str]]:
        runner, command = self._command(environment, active_resources)
        environment.update(runner.kill_env())
        return command.argv, runner.kill_commands()[0], environment


class _MpiStyle(_Adapter):
    """Runners whose `get_cmd` returns the argv; variables the backend reads from its environment
    (srun's forwarded exports) are added to `environment`, which the caller starts it with."""

    def __init__(self, args: Any, world_info_base64: str, resource_pool: Resources) -> None:
        super().__init__(args, world_info_base64)
        self.resource_pool = resource_pool

    def get_cmd(self, environment: MutableMapping[str, str], active_resources: Resources) -> list[str]:
        return self._command(environment, active_resources)[1].argv


class OpenMPIRunner(_MpiStyle):
    """Open MPI's `mpirun`, with DeepSpeed's `--mca btl_tcp_if_include eth0` unless `--launcher_args` pick one."""

    _ds = _mpi_runners.OpenMPIRunner

    def _make(self, plan: Any) -> _DsRunner:
        return _mpi_runners.OpenMPIRunner(plan, tcp_interface="eth0")


class MPICHRunner(_MpiStyle):
    """MPICH's hydra `mpirun`."""

    _ds = _mpi_runners.MPICHRunner


class IMPIRunner(_MpiStyle):
    """Intel MPI's `mpirun`, one MPMD block per rank."""

    _ds = _mpi_runners.IMPIRunner


class MVAPICHRunner(_MpiStyle):
    """MVAPICH2-GDR's `mpirun` (writes its hostfile under the temp directory)."""

    _ds = _mpi_runners.MVAPICHRunner


class SlurmRunner(_MpiStyle):
    """`srun`; the forwarded variables go into `environment` (srun passes them on with `--export=ALL`)."""

    _ds = _slurm_runner.SlurmRunner
