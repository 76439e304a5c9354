"""The `deepspeed` command end to end with tiny torch-free workers: exit codes, messages, flags, pid file,
the MPICH helper, the console-script entry point."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# The report goes out in one write(): the launcher runs ranks with `python -u`, where print() writes the text
# and its newline separately, so two ranks' lines could interleave on the shared stdout (as train_job.py says).
PROBE = """\
import json, os, sys
report = {"rank": os.environ["RANK"], "argv": sys.argv[1:], "ppid": os.getppid(),
          "pidfile": open(f"/tmp/{os.getppid()}.deepspeed").read() if "--pidfile" in sys.argv else None}
os.write(1, (json.dumps(report) + "\\n").encode())
sys.exit(int(os.environ.get("EXIT_" + os.environ["RANK"], "0")))
"""


@pytest.fixture
def probe(tmp_path: Path) -> Path:
    path = tmp_path / "probe.py"
    path.write_text(PROBE)
    return path


def test_exit_code_of_the_failing_rank_is_the_jobs(launcher, probe: Path) -> None:
    done = launcher.run("--num_gpus", "2", str(probe), timeout=60, env=launcher.env(EXIT_1="3"))
    assert done.returncode == 3, done.stderr
    assert "rank 1 (pid" in done.stderr and "exited with code 3" in done.stderr


def test_user_args_and_local_rank(launcher, probe: Path) -> None:
    done = launcher.run("--num_gpus", "2", str(probe), "--x", "a b", "it's", timeout=60)
    assert done.returncode == 0, done.stderr
    argv = {r["rank"]: r["argv"] for r in done.reports}
    assert argv == {"0": ["--local_rank=0", "--x", "a b", "it's"], "1": ["--local_rank=1", "--x", "a b", "it's"]}
    done = launcher.run("--num_gpus", "1", "--no_local_rank", str(probe), "--x", timeout=60)
    assert done.reports[0]["argv"] == ["--x"]


def test_module_and_no_python(launcher, tmp_path: Path, probe: Path) -> None:
    done = launcher.run(
        "--num_gpus",
        "1",
        "--module",
        "probe",
        "-v",
        timeout=60,
        env=launcher.env(PYTHONPATH=f"{tmp_path}:{os.environ.get('PYTHONPATH', '')}"),
    )
    assert done.returncode == 0, done.stderr
    assert done.reports[0]["argv"] == ["--local_rank=0", "-v"]
    script = tmp_path / "run.sh"
    script.write_text('#!/bin/sh\necho "{\\"rank\\": \\"$RANK\\", \\"argv\\": \\"$*\\"}"\n')
    script.chmod(0o755)
    done = launcher.run("--num_gpus", "2", "--no_python", str(script), "x", timeout=60)
    assert done.returncode == 0, done.stderr
    assert sorted((r["rank"], r["argv"]) for r in done.reports) == [
        ("0", "--local_rank=0 x"),
        ("1", "--local_rank=1 x"),
    ]


def test_program_that_cannot_start(launcher, tmp_path: Path) -> None:
    done = launcher.run("--num_gpus", "2", "--no_python", str(tmp_path / "no-such-program"), timeout=60)
    assert done.returncode == 127
    assert f"cannot start rank 0 ({tmp_path / 'no-such-program'}): [Errno 2] No such file or directory" in done.stderr
    text = tmp_path / "not-executable.sh"
    text.write_text("echo hi\n")
    done = launcher.run("--num_gpus", "2", "--no_python", str(text), timeout=60)
    assert done.returncode == 126 and "Permission denied" in done.stderr


def test_save_pid_file_exists_during_the_run_only(launcher, probe: Path) -> None:
    proc = launcher.start("--num_gpus", "1", "--save_pid", str(probe), "--pidfile")
    done = launcher.wait(proc, timeout=60)
    assert done.returncode == 0, done.stderr
    (report,) = done.reports
    assert report["pidfile"] == str(report["ppid"]) == str(proc.pid)  # the runner became the node launcher
    assert not Path(f"/tmp/{proc.pid}.deepspeed").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["-H", "/nonexistent/hostfile", "t.py"],
            "[deepspeed] ERROR error: --hostfile '/nonexistent/hostfile' does not "
            "exist; pass an existing file, or omit --hostfile",
        ),
        (
            ["--num_gpus", "2", "-i", "localhost:0", "t.py"],
            "[deepspeed] ERROR error: --num_nodes/--num_gpus cannot be combined with --include/--exclude",
        ),
        (["--launcher", "torchrun", "t.py"], "argument --launcher: invalid choice: 'torchrun'"),
    ],
)
def test_bad_invocations_exit_2_with_the_reason(launcher, argv: list[str], message: str) -> None:
    done = launcher.run(*argv, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr


def test_missing_backend_is_reported_before_anything_starts(launcher, tmp_path: Path, probe: Path) -> None:
    hostfile = tmp_path / "hf"
    hostfile.write_text("worker-0 slots=1\nworker-1 slots=1\n")
    done = launcher.run(
        "-H",
        str(hostfile),
        "--master_addr",
        "10.0.0.1",
        "--no_ssh_check",
        str(probe),
        timeout=60,
        env=launcher.env(PATH=str(tmp_path)),
    )
    assert done.returncode == 2
    assert (
        "[deepspeed] ERROR not installed: --launcher pdsh needs `pdsh`, which is not on PATH; install pdsh "
        "(apt-get install pdsh, yum install pdsh)"
    ) in done.stderr


def test_bad_env_file_is_reported(launcher, tmp_path: Path, probe: Path) -> None:
    (tmp_path / ".deepspeed_env").write_text("GOOD=1\nbroken line\n")
    done = launcher.run("--num_gpus", "1", str(probe), timeout=60)
    assert done.returncode == 2
    assert f"{tmp_path}/.deepspeed_env:2: 'broken line' is not KEY=VALUE" in done.stderr
    assert done.reports == []


def _helper(env: dict[str, str], probe: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    return subprocess.run(
        [sys.executable, "-m", "ds_launcher.launcher_helper", "--launcher", "mpich", *extra, str(probe), "--y"],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_mpich_helper_maps_pmi_variables(probe: Path) -> None:
    done = _helper({"PMI_RANK": "3", "MPI_LOCALRANKID": "1"}, probe)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["argv"] == ["--local_rank=1", "--y"]
    assert json.loads(done.stdout)["rank"] == "3"
    done = _helper({"PMI_RANK": "3", "PMIX_RANK": "2", "MPI_LOCALRANKID": "1"}, probe)
    assert done.returncode != 0
    assert "RANK: the MPI variables disagree: {'PMI_RANK': '3', 'PMIX_RANK': '2'}" in done.stderr
    done = _helper({"PMI_RANK": "0"}, probe)
    assert "LOCAL_RANK: none of MPI_LOCALRANKID, PALS_LOCAL_RANKID is set" in done.stderr


def test_console_script_entry_point() -> None:
    try:
        dist = importlib.metadata.distribution("ds-launcher")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("ds-launcher is not installed (running from sources)")
    scripts = {ep.name: ep.value for ep in dist.entry_points if ep.group == "console_scripts"}
    assert scripts["deepspeed"] == "ds_launcher.runner:cli"
