"""Discovery of rank layout from torch env, SLURM and the single-process fallback (MPI runs for real in dist/)."""

from __future__ import annotations

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
