"""The pre-launch ssh check asks every remote host at once and names each one that does not answer.

An `ssh` stand-in on PATH plays the hosts: `good*` answer, `bad*` fail as an unknown host would,
`slow*` answer after a delay (to show the hosts are asked concurrently).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from ds_launcher._reachability import UnreachableHostError, check_hosts_reachable, ssh_check_command

FAKE_SSH = """\
#!{python}
import sys, time
args = sys.argv[1:]
with open({log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
while args[0].startswith("-"):
    args = args[2:]
host = args[0]
if host.startswith("bad"):
    sys.stderr.write(f"ssh: connect to host {{host}} port 22: No route to host\\n")
    sys.exit(255)
if host.startswith("slow"):
    time.sleep(1.5)
"""


@pytest.fixture
def fake_ssh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    log = tmp_path / "ssh.log"
    ssh = bindir / "ssh"
    ssh.write_text(FAKE_SSH.format(python=sys.executable, log=str(log)))
    ssh.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return log


def test_command_never_prompts_and_bounds_the_connect() -> None:
    assert ssh_check_command("w1", 2222, 7) == [
        "ssh",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=7",
        "-p",
        "2222",
        "w1",
        "true",
    ]
    assert ssh_check_command("w1", None) == ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=10", "w1", "true"]


def test_every_unreachable_host_is_named(fake_ssh: Path) -> None:
    with pytest.raises(UnreachableHostError) as info:
        check_hosts_reachable(["good0", "bad1", "good2", "bad3"], 2222)
    message = str(info.value)
    assert "2 host(s) not reachable" in message
    assert "bad1 (ssh: connect to host bad1 port 22: No route to host)" in message and "bad3 (" in message
    assert "good0" not in message.split("Nothing was started")[0]
    assert "--no_ssh_check" in message
    asked = sorted(line.split()[-2] for line in fake_ssh.read_text().splitlines())
    assert asked == ["bad1", "bad3", "good0", "good2"]
    assert all("-p 2222" in line for line in fake_ssh.read_text().splitlines())


def test_hosts_are_asked_concurrently_and_local_ones_skipped(fake_ssh: Path) -> None:
    start = time.monotonic()
    check_hosts_reachable(["here", "slow1", "slow2", "slow3", "slow1"], None, is_local=lambda h: h == "here")
    took = time.monotonic() - start
    assert took < 4.0, f"three 1.5 s hosts took {took:.1f}s: not asked at once"
    asked = [line.split()[-2] for line in fake_ssh.read_text().splitlines()]
    assert sorted(asked) == ["slow1", "slow2", "slow3"]  # each once; never the local host
