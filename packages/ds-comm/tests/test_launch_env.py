"""Discovery of rank layout from torch env, SLURM and the single-process fallback (MPI runs for real in dist/)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from ds_comm._launch_env import discover, expand_slurm_nodelist, is_mpi_launch


def test_torch_env_wins() -> None:
    env = {
        "RANK": "3",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "1234",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "2",
    }
    info = discover(auto_mpi_discovery=True, default_port=29500, env=env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (3, 8, 1, 4)
    assert (info.master_addr, info.master_port, info.source) == ("10.0.0.1", 1234, "env")


def test_torch_env_defaults() -> None:
    info = discover(auto_mpi_discovery=True, default_port=29511, env={"RANK": "0", "WORLD_SIZE": "1"})
    assert (info.master_addr, info.master_port, info.local_rank) == ("127.0.0.1", 29511, 0)


def test_bad_integer_env_is_named() -> None:
    with pytest.raises(ValueError, match=r"RANK='zero' must be an integer"):
        discover(auto_mpi_discovery=True, default_port=1, env={"RANK": "zero", "WORLD_SIZE": "2"})


def test_slurm() -> None:
    env = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[07-10]"}
    info = discover(auto_mpi_discovery=True, default_port=29500, env=env)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (5, 8, 1, 2)
    assert (info.master_addr, info.source) == ("gpu07", "slurm")


@pytest.mark.parametrize(
    ("nodelist", "hosts"),
    [
        ("node1", ["node1"]),
        ("a,b", ["a", "b"]),
        ("n[1-3]", ["n1", "n2", "n3"]),
        ("n[08-10,15],gpu", ["n08", "n09", "n10", "n15", "gpu"]),
        ("r[1-2]x", ["r1x", "r2x"]),
    ],
)
def test_slurm_nodelist(nodelist: str, hosts: list[str]) -> None:
    assert expand_slurm_nodelist(nodelist) == hosts


def test_mpi_markers() -> None:
    assert is_mpi_launch({"OMPI_COMM_WORLD_SIZE": "2"})
    assert is_mpi_launch({"PMI_RANK": "0"})
    assert not is_mpi_launch({"HOME": "/root"})


def test_mpi_markers_ignored_when_discovery_off() -> None:
    info = discover(auto_mpi_discovery=False, default_port=29500, env={"OMPI_COMM_WORLD_SIZE": "2"})
    assert (info.world_size, info.source) == (1, "single")


def test_plain_python_is_world_of_one() -> None:
    info = discover(auto_mpi_discovery=True, default_port=29500, env={})
    assert (info.rank, info.world_size, info.source) == (0, 1, "single")


def test_a_world_of_one_takes_master_port_from_its_env_else_a_free_port() -> None:
    assert discover(auto_mpi_discovery=False, default_port=29500, env={"MASTER_PORT": "31234"}).master_port == 31234
    port = discover(auto_mpi_discovery=False, default_port=29500, env={}).master_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))  # it was free: nothing else chose it


_INIT_WHILE_29500_IS_TAKEN = """
import os, socket
for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(k, None)
blocker = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
blocker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    blocker.bind(("0.0.0.0", 29500)); blocker.listen()
except OSError:
    pass  # someone else already holds 29500, which is the point
import ds_comm
ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
print("world", ds_comm.get_world_size(), "port", os.environ["MASTER_PORT"])
"""


def test_a_plain_script_initialises_while_port_29500_is_taken() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _INIT_WHILE_29500_IS_TAKEN], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("world 1 port ") and "port 29500" not in out.stdout
