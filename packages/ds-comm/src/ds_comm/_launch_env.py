"""Where this process sits in the job: read from torchrun/launcher env, an MPI launch, or SLURM."""

from __future__ import annotations

import logging
import os
import re
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: Variables whose presence means "started by mpirun/mpiexec" (OpenMPI, PMIx, MPICH/Hydra, Intel MPI, MVAPICH).
MPI_ENV_MARKERS = (
    "OMPI_COMM_WORLD_SIZE",
    "PMIX_RANK",
    "PMI_SIZE",
    "PMI_RANK",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_SIZE",
)


@dataclass(frozen=True, kw_only=True)
class LaunchInfo:
    """Rank layout of the job and the rendezvous address."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str
    """Where the figures came from: "env", "mpi", "slurm", "args" or "single"."""

    def export(self) -> None:
        """Write the torch env contract so `init_process_group(init_method="env://")` and children see it."""
        os.environ["RANK"] = str(self.rank)
        os.environ["WORLD_SIZE"] = str(self.world_size)
        os.environ["LOCAL_RANK"] = str(self.local_rank)
        os.environ["LOCAL_WORLD_SIZE"] = str(self.local_world_size)
        os.environ["MASTER_ADDR"] = self.master_addr
        os.environ["MASTER_PORT"] = str(self.master_port)


def _int_env(env: Mapping[str, str], *names: str, default: int | None = None) -> int | None:
    for name in names:
        value = env.get(name)
        if value is not None and value != "":
            try:
                return int(value)
            except ValueError:
                raise ValueError(f"environment variable {name}={value!r} must be an integer") from None
    return default


def from_torch_env(env: Mapping[str, str], default_port: int) -> LaunchInfo | None:
    """torchrun / `deepspeed` launcher contract: RANK and WORLD_SIZE (+ LOCAL_RANK, MASTER_*)."""
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    rank = _int_env(env, "RANK")
    world = _int_env(env, "WORLD_SIZE")
    assert rank is not None and world is not None
    local_rank = _int_env(env, "LOCAL_RANK", default=0)
    local_world = _int_env(env, "LOCAL_WORLD_SIZE", "LOCAL_SIZE", default=world)
    return LaunchInfo(
        rank=rank,
        world_size=world,
        local_rank=local_rank or 0,
        local_world_size=local_world or world,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int_env(env, "MASTER_PORT", default=default_port) or default_port,
        source="env",
    )


def is_mpi_launch(env: Mapping[str, str]) -> bool:
    return any(name in env for name in MPI_ENV_MARKERS)


def from_mpi(default_port: int) -> LaunchInfo:
    """Ask MPI itself (through mpi4py) for rank, size, node-local rank and rank 0's address."""
    try:
        from mpi4py import MPI
    except ImportError:
        raise RuntimeError(
            "this process was started by an MPI launcher (mpirun/mpiexec) but mpi4py is not installed; "
            "pip install 'ds-comm[mpi]', or pass auto_mpi_discovery=False and set RANK/WORLD_SIZE yourself"
        ) from None
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank, local_world = node_comm.Get_rank(), node_comm.Get_size()
    node_comm.Free()
    master_addr = comm.bcast(_host_address() if rank == 0 else None, root=0)
    master_port = comm.bcast(int(os.environ.get("MASTER_PORT", default_port)) if rank == 0 else None, root=0)
    return LaunchInfo(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=master_addr,
        master_port=master_port,
        source="mpi",
    )


def _host_address() -> str:
    hostname = socket.gethostname()
    try:
        return socket.gethostbyname(hostname)
    except OSError:
        return "127.0.0.1"


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand SLURM's compressed host list (`node[01-03,07],gpu5`) into host names."""
    hosts: list[str] = []
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,]*)?", nodelist):
        part = part.strip(",")
        match = re.fullmatch(r"(.*)\[(.*)\](.*)", part)
        if not match:
            if part:
                hosts.append(part)
            continue
        prefix, ranges, suffix = match.groups()
        for item in ranges.split(","):
            if "-" in item:
                lo, hi = item.split("-", 1)
                for n in range(int(lo), int(hi) + 1):
                    hosts.append(f"{prefix}{str(n).zfill(len(lo))}{suffix}")
            else:
                hosts.append(f"{prefix}{item}{suffix}")
    return hosts


def from_slurm(env: Mapping[str, str], default_port: int) -> LaunchInfo | None:
    """An `srun` launch: SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, master = first node of the step."""
    if "SLURM_PROCID" not in env or "SLURM_NTASKS" not in env:
        return None
    rank = _int_env(env, "SLURM_PROCID")
    world = _int_env(env, "SLURM_NTASKS")
    assert rank is not None and world is not None
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    hosts = _scontrol_hostnames(nodelist) or expand_slurm_nodelist(nodelist)
    master = env.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    local_world = _int_env(env, "SLURM_NTASKS_PER_NODE", default=None)
    if local_world is None:
        local_world = max(1, world // max(1, len(hosts)))
    return LaunchInfo(
        rank=rank,
        world_size=world,
        local_rank=_int_env(env, "SLURM_LOCALID", default=0) or 0,
        local_world_size=local_world,
        master_addr=master,
        master_port=_int_env(env, "MASTER_PORT", default=default_port) or default_port,
        source="slurm",
    )


def _scontrol_hostnames(nodelist: str) -> list[str]:
    if not nodelist:
        return []
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return out.stdout.split()


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def single_process(env: Mapping[str, str]) -> LaunchInfo:
    """`python train.py` with no launcher: a world of one.

    Only this process ever joins its rendezvous store, so unless MASTER_PORT says otherwise it listens
    on a free port, not DeepSpeed's fixed 29500: two un-launched scripts on one machine (two notebooks,
    or a script beside a test run) would otherwise both bind 29500 and the second would fail with
    EADDRINUSE.
    """
    return LaunchInfo(
        rank=0,
        world_size=1,
        local_rank=0,
        local_world_size=1,
        master_addr="127.0.0.1",
        master_port=_int_env(env, "MASTER_PORT") or free_port(),
        source="single",
    )


def discover(*, auto_mpi_discovery: bool, default_port: int, env: Mapping[str, str] | None = None) -> LaunchInfo:
    """The first of: torch env, MPI (when allowed), SLURM, single process."""
    env = os.environ if env is None else env
    info = from_torch_env(env, default_port)
    if info is not None:
        return info
    if auto_mpi_discovery and is_mpi_launch(env):
        return from_mpi(default_port)
    info = from_slurm(env, default_port)
    if info is not None:
        return info
    return single_process(env)
