"""Real training runs through the launcher on CPU ranks (gloo): `deepspeed --num_gpus 2`, two `--no_ssh`
node processes forming one 4-rank job, and the same worker under torchrun.

The worker (`tests/train_job.py`) trains a tiny model data-parallel with ds_comm all-reduce and a
single-process full-batch reference; matching parameters prove the ranks formed one group.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ds_comm.testing import free_port

AWKWARD = {"MSG": 'it\'s "quoted" and spaced', "DOLLAR": "$HOME `whoami` $(id)", "EQ": "a=b=c"}


def check_training(done_reports: dict[int, dict], world: int) -> None:
    assert sorted(done_reports) == list(range(world))
    for report in done_reports.values():
        assert report["world"] == world
        torch.testing.assert_close(
            torch.tensor(report["params"]), torch.tensor(report["ref_params"]), rtol=1e-5, atol=1e-6
        )
        assert report["losses"][-1] < report["losses"][0]
    first = done_reports[0]["params"]
    assert all(r["params"] == first for r in done_reports.values())  # one model across ranks, bit for bit


@pytest.mark.timeout(120)
def test_num_gpus_2_trains_with_the_env_contract(launcher, tmp_path: Path) -> None:
    env_file = tmp_path / "my.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in AWKWARD.items()))
    port = free_port()
    done = launcher.run(
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        str(launcher.job),
        "--steps",
        "4",
        "--echo",
        "a b",
        'it\'s "q"',
        "--report_env",
        *AWKWARD,
        timeout=100,
        env=launcher.env(DS_ENV_FILE=str(env_file)),
    )
    assert done.returncode == 0, done.stderr
    reports = done.by_event("done")
    check_training(reports, world=2)
    for rank, report in reports.items():
        assert report["env"] == {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_SIZE": "2",
            "LOCAL_WORLD_SIZE": "2",
            "CROSS_RANK": "0",
            "CROSS_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "CUDA_VISIBLE_DEVICES": "0,1",
            "OMP_NUM_THREADS": report["env"]["OMP_NUM_THREADS"],
            **AWKWARD,
        }
        assert report["arg_local_rank"] == report["local_rank"] == rank
        assert report["echo"] == ["a b", 'it\'s "q"']


@pytest.mark.timeout(150)
def test_no_ssh_node_ranks_form_one_four_rank_job(launcher, tmp_path: Path) -> None:
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n127.0.0.1 slots=2\n")
    logs = tmp_path / "node1-logs"
    common = ["-H", str(hostfile), "--no_ssh", "--master_port", str(free_port())]
    node0 = launcher.start(*common, "--node_rank", "0", str(launcher.job), "--steps", "3", name="node0")
    node1 = launcher.start(
        *common,
        "--node_rank",
        "1",
        "--enable_each_rank_log",
        str(logs),
        str(launcher.job),
        "--steps",
        "3",
        name="node1",
    )
    done0, done1 = launcher.wait(node0, timeout=130), launcher.wait(node1, timeout=30)
    assert done0.returncode == 0, done0.stderr
    assert done1.returncode == 0, done1.stderr
    reports = done0.by_event("done")
    for log in sorted(logs.iterdir()):
        reports.update({r["rank"]: r for r in launcher.parse_reports(log.read_text()) if r["event"] == "done"})
    check_training(reports, world=4)
    assert [(reports[r]["env"]["CROSS_RANK"], reports[r]["env"]["LOCAL_RANK"]) for r in range(4)] == [
        ("0", "0"),
        ("0", "1"),
        ("1", "0"),
        ("1", "1"),
    ]
    assert {r["env"]["CROSS_SIZE"] for r in reports.values()} == {"2"}
    assert {r["env"]["WORLD_SIZE"] for r in reports.values()} == {"4"}


@pytest.mark.timeout(120)
def test_torchrun_runs_the_same_worker(launcher) -> None:
    done = launcher.run(
        "--standalone",
        "--nproc_per_node",
        "2",
        str(launcher.job),
        "--steps",
        "4",
        module="torch.distributed.run",
        timeout=100,
    )
    assert done.returncode == 0, done.stderr
    reports = done.by_event("done")
    check_training(reports, world=2)
    assert [reports[r]["local_rank"] for r in range(2)] == [0, 1]  # from torchrun's env, via ds_comm
