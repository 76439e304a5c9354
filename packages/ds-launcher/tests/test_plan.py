"""Planning without starting anything: the runner's checks and choices, the node launcher's per-rank plan."""

from __future__ import annotations

import argparse
import os
import socket
import sys
from pathlib import Path

import pytest

from ds_launcher import OpenMPIRunner, PDSHRunner, SlurmRunner, collect_exports, encode_world_info
from ds_launcher._args import parse_args
from ds_launcher._cores import parse_core_list, split_cores
from ds_launcher.launch import build_parser as launch_parser
from ds_launcher.launch import plan_ranks
from ds_launcher.runner import plan_launch


def _hostfile(tmp_path: Path, text: str) -> str:
    path = tmp_path / f"hostfile{len(list(tmp_path.glob('hostfile*')))}"
    path.write_text(text)
    return str(path)


def _plan(tmp_path: Path, *argv: str, environ: dict[str, str] | None = None):
    return plan_launch(parse_args([*argv]), environ or {}, cwd=str(tmp_path), home=str(tmp_path / "home"))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--min_elastic_nodes", "2"],
            "--elastic_training/--min_elastic_nodes/--max_elastic_nodes: elastic training "
            "is not supported by ds-launcher; launch a fixed set of nodes",
        ),
        (
            ["--module", "--no_python"],
            "--no_python and --module cannot be used together: --module runs the script "
            "with `python -m`, --no_python runs it without python",
        ),
        (
            ["-i", "localhost:0", "--num_gpus", "1"],
            "--num_nodes/--num_gpus cannot be combined with --include/--exclude; select resources one way or the other",
        ),
        (
            ["--num_nodes", "2", "--num_gpus", "1"],
            "--num_nodes 2 needs a hostfile listing the other nodes; pass --hostfile",
        ),
        (
            ["--no_ssh", "--num_gpus", "2"],
            "--no_ssh needs --node_rank in 0..0 (this node's index among localhost), got -1",
        ),
    ],
)
def test_flag_errors(tmp_path: Path, argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        _plan(tmp_path, *argv, "train.py")
    assert str(info.value) == message


def test_single_host_cpu_ranks(tmp_path: Path) -> None:
    launch = _plan(tmp_path, "--num_gpus", "3", "train.py", "--lr", "1")
    assert not launch.multi_node
    assert launch.plan.active == {"localhost": [0, 1, 2]}
    assert launch.plan.master_addr == "127.0.0.1"
    assert launch.plan.user_args == ("--lr", "1")
    assert _plan(tmp_path, "--num_procs", "2", "t.py").plan.active == {"localhost": [0, 1]}  # the CPU alias


def test_no_hostfile_and_no_count_asks_the_accelerator(tmp_path: Path) -> None:
    # DS_ACCELERATOR is cpu in this suite, or the host really has no GPU: one CPU rank.
    from ds_comm import get_accelerator

    if get_accelerator().name != "cpu":
        pytest.skip("a GPU host: the count is its device count")
    assert _plan(tmp_path, "t.py").plan.active == {"localhost": [0]}


def test_multi_node_choice(tmp_path: Path) -> None:
    two = _hostfile(tmp_path, "worker-0 slots=2\nworker-1 slots=2\n")
    launch = _plan(tmp_path, "-H", two, "--master_addr", "10.0.0.1", "t.py")
    assert launch.multi_node and launch.plan.active == {"worker-0": [0, 1], "worker-1": [0, 1]}
    one = _hostfile(tmp_path, "localhost slots=2\n")
    assert not _plan(tmp_path, "-H", one, "t.py").multi_node
    assert _plan(tmp_path, "-H", one, "--force_multi", "t.py").multi_node
    launch = _plan(tmp_path, "-H", two, "--no_ssh", "--node_rank", "1", "t.py")
    assert not launch.multi_node
    assert launch.plan.master_addr == "worker-0"  # --no_ssh: node 0's name, no ssh lookup
    launch = _plan(tmp_path, "-H", two, "-i", "worker-1:1", "--master_addr", "10.0.0.1", "t.py")
    # One host, but another one: started here, its ranks would wait for a master nobody starts.
    assert launch.plan.active == {"worker-1": [1]} and launch.multi_node and launch.plan.filtered
    here = _hostfile(tmp_path, "127.0.0.1 slots=1\nworker-1 slots=1\n")
    assert not _plan(tmp_path, "-H", here, "-i", "127.0.0.1", "t.py").multi_node


def test_this_host_by_any_of_its_addresses() -> None:
    from ds_launcher.runner import is_this_host

    assert is_this_host("localhost") and is_this_host("127.0.0.2")  # all of 127/8 is this machine's
    assert is_this_host(socket.gethostname())
    assert not is_this_host("192.0.2.1")  # TEST-NET-1: documentation only, never assigned to a host
    assert not is_this_host("no-such-host.invalid")


def test_local_hosts_use_loopback(tmp_path: Path) -> None:
    hostfile = _hostfile(tmp_path, "localhost slots=1\n127.0.0.1 slots=1\n")
    launch = _plan(tmp_path, "-H", hostfile, "--launcher", "ssh", "t.py")
    assert launch.multi_node and launch.plan.master_addr == "127.0.0.1"


def test_backend_limits_are_checked_before_launch(tmp_path: Path) -> None:
    hostfile = _hostfile(tmp_path, "worker-0 slots=4\nworker-1 slots=2\n")
    with pytest.raises(ValueError, match="--launcher slurm needs the same slot count on every host"):
        _plan(tmp_path, "-H", hostfile, "--launcher", "slurm", "--master_addr", "x", "t.py")
    with pytest.raises(ValueError, match=r"--launcher openmpi cannot select specific device ids, got \[1\]"):
        _plan(tmp_path, "-H", hostfile, "--launcher", "openmpi", "-i", "worker-0:1", "--master_addr", "x", "t.py")


def test_cli_to_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("ds_launcher._mpi_runners.os.geteuid", lambda: 1000)
    hostfile = _hostfile(tmp_path, "worker-0 slots=2\nworker-1 slots=2\n")
    environ = {"NCCL_IB_DISABLE": "1", "PATH": "/bin"}
    launch = _plan(
        tmp_path,
        "-H",
        hostfile,
        "--launcher",
        "openmpi",
        "--master_addr",
        "10.0.0.1",
        "--master_port",
        "1234",
        "--launcher_args",
        "--bind-to none",
        "t.py",
        "x y",
        environ=environ,
    )
    exports = collect_exports(environ, cwd=str(tmp_path), home=str(tmp_path / "home"))
    (cmd,) = OpenMPIRunner(launch.plan).commands(exports)
    assert cmd.argv == [
        "mpirun",
        "-n",
        "4",
        "--host",
        "worker-0:2,worker-1:2",
        "--mca",
        "btl",
        "^openib",
        "--bind-to",
        "none",
        "-x",
        f"PYTHONPATH={tmp_path}",
        "-x",
        "NCCL_IB_DISABLE=1",
        "-x",
        "MASTER_ADDR=10.0.0.1",
        "-x",
        "MASTER_PORT=1234",
        sys.executable,
        "-u",
        "t.py",
        "x y",
    ]
    launch = _plan(
        tmp_path,
        "-H",
        hostfile,
        "-e",
        "worker-0",
        "--force_multi",
        "--launcher",
        "slurm",
        "--master_addr",
        "10.0.0.1",
        "t.py",
    )
    assert SlurmRunner(launch.plan).commands({})[0].argv[:10] == [
        "srun",
        "-n",
        "2",
        "--ntasks-per-node",
        "2",
        "--kill-on-bad-exit=1",
        "--quit-on-interrupt",
        "--nodelist",
        "worker-1",
        "--nodes",
    ]
    launch = _plan(tmp_path, "-H", hostfile, "--master_addr", "10.0.0.1", "--save_pid", "t.py")
    remote = PDSHRunner(launch.plan).commands({})[0].argv[-1]
    assert f"--world_info={encode_world_info({'worker-0': [0, 1], 'worker-1': [0, 1]})} --node_rank=%n" in remote
    assert f"--save_pid {os.getpid()} " in remote


def test_visible_devices_are_dropped_when_counts_are_given(tmp_path: Path) -> None:
    launch = _plan(tmp_path, "--num_gpus", "2", "t.py", environ={"CUDA_VISIBLE_DEVICES": "3,5", "A": "1"})
    assert launch.env == {"A": "1"} and launch.plan.active == {"localhost": [0, 1]}


def test_local_env_gets_the_env_file(tmp_path: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("MSG=a 'b' \"c\"\n")
    launch = _plan(tmp_path, "--num_gpus", "1", "t.py", environ={"X": "1"})
    assert launch.env == {"X": "1", "MSG": "a 'b' \"c\""}


# --- the node launcher ---------------------------------------------------------------------------------------

WORLD = {"node-a": [0, 1], "node-b": [2, 3]}


def _launch_args(*argv: str) -> argparse.Namespace:
    return launch_parser().parse_args([f"--world_info={encode_world_info(WORLD)}", *argv])


def test_rank_plan_contract() -> None:
    plans = plan_ranks(
        _launch_args("--node_rank=1", "--master_addr=10.0.0.1", "--master_port=1234", "train.py", "--x", "1"),
        {"KEEP": "me"},
    )
    assert [(p.rank, p.local_rank) for p in plans] == [(2, 0), (3, 1)]
    contract = {
        k: plans[1].env[k]
        for k in (
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
            "KEEP",
        )
    }
    assert contract == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "CROSS_RANK": "1",
        "CROSS_SIZE": "2",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "CUDA_VISIBLE_DEVICES": "2,3",
        "KEEP": "me",
    }
    assert plans[1].argv == [sys.executable, "-u", "train.py", "--local_rank=1", "--x", "1"]
    assert plans[0].log_path is None and plans[0].cores is None


def test_rank_plan_variants() -> None:
    assert plan_ranks(_launch_args("--module", "--no_local_rank", "pkg.train", "-v"), {})[1].argv == [
        sys.executable,
        "-u",
        "-m",
        "pkg.train",
        "-v",
    ]
    assert plan_ranks(_launch_args("--no_python", "./run.sh", "a"), {})[0].argv == ["./run.sh", "--local_rank=0", "a"]
    assert plan_ranks(_launch_args("t.py"), {})[0].env["OMP_NUM_THREADS"] == str(
        max(1, len(os.sched_getaffinity(0)) // 2)
    )
    assert plan_ranks(_launch_args("t.py"), {"OMP_NUM_THREADS": "7"})[0].env["OMP_NUM_THREADS"] == "7"


def test_rank_logs_and_bound_cores(tmp_path: Path) -> None:
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two cores")
    plans = plan_ranks(
        _launch_args(
            f"--enable_each_rank_log={tmp_path / 'logs'}",
            "--bind_cores_to_rank",
            f"--bind_core_list={cores[0]},{cores[1]}",
            "t.py",
        ),
        {},
    )
    assert (tmp_path / "logs").is_dir()
    assert [Path(p.log_path).name.split("_", 1)[1] for p in plans] == ["rank0.log", "rank1.log"]  # type: ignore[arg-type]
    assert [p.cores for p in plans] == [[cores[0]], [cores[1]]]
    assert [p.env["OMP_NUM_THREADS"] for p in plans] == ["1", "1"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["t.py"], "--world_info is required (base64url JSON {host: [slots]}, written by `deepspeed`)"),
        (
            [f"--world_info={encode_world_info(WORLD)}", "--node_rank=2", "t.py"],
            "--node_rank 2 is outside the world info's 2 node(s) (node-a, node-b); use 0..1",
        ),
        (
            [f"--world_info={encode_world_info(WORLD)}", "--module", "--no_python", "t.py"],
            "--no_python and --module cannot be used together: --module runs the script with `python -m`, --no_python "
            "runs it without python",
        ),
    ],
)
def test_rank_plan_errors(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError) as info:
        plan_ranks(launch_parser().parse_args(argv), {})
    assert str(info.value) == message


def test_rank_log_dir_must_not_be_a_file(tmp_path: Path) -> None:
    afile = tmp_path / "f"
    afile.write_text("")
    with pytest.raises(ValueError) as info:
        plan_ranks(_launch_args(f"--enable_each_rank_log={afile}", "t.py"), {})
    assert str(info.value) == f"--enable_each_rank_log '{afile}' is a file; pass a directory for the per-rank logs"


@pytest.mark.parametrize(("text", "cores"), [("0", [0]), ("0,2-4,7", [0, 2, 3, 4, 7]), ("3-3,1,1", [1, 3])])
def test_core_list(text: str, cores: list[int]) -> None:
    assert parse_core_list(text) == cores


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("0,a", "--bind_core_list '0,a': 'a' is not a core id or range; write e.g. '0,2-4,7'"),
        ("4-2", "--bind_core_list '4-2': range '4-2' runs backwards; write it as '2-4'"),
        ("", "--bind_core_list '': '' is not a core id or range; write e.g. '0,2-4,7'"),
    ],
)
def test_bad_core_list(text: str, message: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_core_list(text)
    assert str(info.value) == message


def test_split_cores_errors() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(
        ValueError,
        match=rf"^--bind_cores_to_rank: {len(allowed)} core\(s\) for {len(allowed) + 1} "
        "local ranks; each rank needs at least one core",
    ):
        split_cores(len(allowed) + 1)
    with pytest.raises(ValueError, match=r"^--bind_core_list '100000': cores \[100000\] are not available"):
        split_cores(1, "100000")
    assert split_cores(1, str(allowed[0])) == [[allowed[0]]]
