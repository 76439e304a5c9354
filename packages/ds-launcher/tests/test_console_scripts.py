"""`ds_ssh` (the command lines it builds and runs) and `ds_elastic` (a plain refusal), plus their entry points."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ds_launcher import elastic_cli, ssh_all

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_entry_points_are_declared() -> None:
    scripts = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
    assert scripts["ds_ssh"] == "ds_launcher.ssh_all:main"
    assert scripts["ds_elastic"] == "ds_launcher.elastic_cli:main"


def test_pdsh_gets_every_host_once_and_the_command_quoted() -> None:
    lines = ssh_all.build_commands(["w0", "w1"], ["echo", "a b", "$HOME"], pdsh="/usr/bin/pdsh")
    assert lines == [["/usr/bin/pdsh", "-w", "w0,w1", "echo 'a b' '$HOME'"]]


def test_without_pdsh_each_host_gets_an_ssh_line() -> None:
    assert ssh_all.build_commands(["w0", "w1"], ["nvidia-smi"], pdsh=None) == [
        ["ssh", "w0", "nvidia-smi"],
        ["ssh", "w1", "nvidia-smi"],
    ]


def test_empty_command_is_refused() -> None:
    with pytest.raises(ValueError, match="no command given"):
        ssh_all.build_commands(["w0"], [], pdsh=None)


def _fake(bin_dir: Path, name: str, log: Path, status: int = 0) -> None:
    script = bin_dir / name
    script.write_text(f'#!/bin/sh\necho "{name} $PDSH_RCMD_TYPE $*" >> {log}\nexit {status}\n')
    script.chmod(0o755)


def test_main_runs_pdsh_over_the_hostfile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    hostfile, log = tmp_path / "hostfile", tmp_path / "calls.log"
    hostfile.write_text("# cluster\nworker-0 slots=4\n\nworker-1 slots=8  # big one\n")
    _fake(tmp_path, "pdsh", log)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    assert ssh_all.main(["-f", str(hostfile), "hostname", "-s"]) == 0
    assert log.read_text() == "pdsh ssh -w worker-0,worker-1 hostname -s\n"
    assert capsys.readouterr().out == f"hostfile={hostfile}\n"


def test_main_falls_back_to_ssh_and_reports_the_first_failure(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hostfile, log = tmp_path / "hostfile", tmp_path / "calls.log"
    hostfile.write_text("a slots=1\nb slots=1\n")
    _fake(tmp_path, "ssh", log, status=3)
    monkeypatch.setenv("PATH", str(tmp_path))  # no pdsh anywhere
    assert ssh_all.main(["-f", str(hostfile), "uptime"]) == 3
    assert log.read_text() == "ssh ssh a uptime\nssh ssh b uptime\n"


def test_missing_hostfile_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ssh_all.main(["-f", str(tmp_path / "nope"), "true"]) == 1
    assert "no hostfile at" in capsys.readouterr().err


def test_ds_elastic_says_elasticity_was_removed() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "ds_launcher.elastic_cli", "-c", "ds_config.json", "-w", "8"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.strip() == elastic_cli.MESSAGE
    assert "removed in DeepSpeed 0.19" in done.stderr and done.stdout == ""
