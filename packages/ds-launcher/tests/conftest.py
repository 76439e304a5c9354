"""Helpers for tests that start real launchers: a clean env, a `launcher` fixture that always cleans up."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ds_comm.testing import free_port

TESTS = Path(__file__).parent
#: The worker script of the real-run tests.
JOB = TESTS / "train_job.py"
#: Variables a launcher sets; a test process must not leak its own into the job.
CONTRACT_VARS = (
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
    "OMP_NUM_THREADS",
    "DS_ENV_FILE",
)


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT_VARS}
    env["DS_ACCELERATOR"] = "cpu"
    env.update(extra)
    return env


def parse_reports(text: str) -> list[dict]:
    """The JSON lines a worker printed."""
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2 :].split()[0] != b"Z"


@dataclass
class Finished:
    returncode: int
    stdout: str
    stderr: str
    seconds: float

    @property
    def reports(self) -> list[dict]:
        return parse_reports(self.stdout)

    def by_event(self, event: str) -> dict[int, dict]:
        return {r["rank"]: r for r in self.reports if r.get("event") == event}


class Launcher:
    """Starts `python -m ds_launcher ...` (the `deepspeed` command) with output to files; kills leftovers.

    Test modules reach the helpers through this fixture object (test dirs are not packages).
    """

    job = JOB
    env = staticmethod(clean_env)
    alive = staticmethod(alive)
    parse_reports = staticmethod(parse_reports)

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.procs: list[subprocess.Popen[bytes]] = []
        self._outputs: dict[int, tuple[Path, Path]] = {}

    def start(
        self,
        *args: str,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        module: str = "ds_launcher",
        name: str = "launcher",
    ) -> subprocess.Popen[bytes]:
        out, err = self.tmp_path / f"{name}.out", self.tmp_path / f"{name}.err"
        if module == "ds_launcher" and "--master_port" not in args and "--help" not in args:
            # A free rendezvous port per job: the default 29500 collides with any other job or test
            # process on this host (a world-of-one init_distributed binds it too).
            args = ("--master_port", str(free_port()), *args)
        with open(out, "wb") as o, open(err, "wb") as e:
            proc = subprocess.Popen(
                [sys.executable, "-m", module, *args],
                cwd=cwd or self.tmp_path,
                env=env or clean_env(),
                stdout=o,
                stderr=e,
                start_new_session=True,
            )
        self.procs.append(proc)
        self._outputs[proc.pid] = (out, err)
        return proc

    def output(self, proc: subprocess.Popen[bytes]) -> tuple[str, str]:
        out, err = self._outputs[proc.pid]
        return out.read_text(errors="replace"), err.read_text(errors="replace")

    def wait(self, proc: subprocess.Popen[bytes], timeout: float) -> Finished:
        start = time.monotonic()
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill(proc)
            out, err = self.output(proc)
            pytest.fail(f"launcher did not finish within {timeout}s\n--- stdout\n{out}\n--- stderr\n{err}")
        out, err = self.output(proc)
        return Finished(rc, out, err, time.monotonic() - start)

    def run(self, *args: str, timeout: float = 90, **kwargs: object) -> Finished:
        return self.wait(self.start(*args, **kwargs), timeout)  # type: ignore[arg-type]

    def wait_for_reports(self, proc: subprocess.Popen[bytes], event: str, count: int, timeout: float) -> dict:
        """Poll the launcher's stdout until `count` reports of `event` arrived."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = {r["rank"]: r for r in parse_reports(self.output(proc)[0]) if r.get("event") == event}
            if len(found) >= count:
                return found
            if proc.poll() is not None:
                break
            time.sleep(0.1)
        out, err = self.output(proc)
        pytest.fail(f"no {count} {event!r} reports within {timeout}s\n--- stdout\n{out}\n--- stderr\n{err}")

    @staticmethod
    def kill(proc: subprocess.Popen[bytes]) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # the launcher's workers die with it (PDEATHSIG)
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


@pytest.fixture
def launcher(tmp_path: Path):
    runner = Launcher(tmp_path)
    yield runner
    for proc in runner.procs:
        runner.kill(proc)
