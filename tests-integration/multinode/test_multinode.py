"""`deepspeed --hostfile` across real hosts: two network namespaces with their own sshd (hosts.sh).

Each test starts the launcher on node0 (or node1) the way a user on a login node would, with the
hostfile `hosts.sh up 2` printed (node0 slots=2, node1 slots=2), and checks what reached the ranks:

- training: examples/train_gpt.py (ZeRO stage 2, AdamW) on 2 nodes x 2 ranks through each runner (pdsh,
  ssh, openmpi, and slurm on a cluster `hosts.sh slurm` starts: slurmctld on node0, slurmd per host) logs
  the same per-step losses as on 1 node x 4 ranks (rank 0's loss; same data shards, same world size,
  so only the reduction's path differs: rtol 1e-5);
- `--include/--exclude` across hosts, `.deepspeed_env` and PYTHONPATH on remote ranks, `--master_addr`
  found through ssh, `--ssh_port`;
- failures: a remote rank raising ends the whole job within 30 s with its traceback and exit status 1;
  SIGTERM/SIGINT to the launcher ends every rank on every host; an unreachable host is named before
  any rank starts.

Needs root (namespaces, sshd). Runs only where DS_MULTINODE=1 (`nox -s multinode` sets it): it
installs Debian packages when missing and changes /etc/hosts and ssh's config until `hosts.sh down`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
HOSTS_SH = HERE / "hosts.sh"
JOB = HERE / "job.py"
TRAIN_GPT = ROOT / "examples" / "train_gpt.py"
ZERO2 = ROOT / "examples" / "ds_config_zero2.json"
NODE0_ADDR = "10.213.0.10"
UNREACHABLE = "10.213.0.99"  # in the hosts' subnet, held by no host
#: Variables a launcher sets, which the test's own environment must not leak into a job.
CONTRACT = (
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
    "DS_ENV_FILE",
)
GPT_ARGS = ("--deepspeed_config", str(ZERO2), "--layers", "2", "--dim", "32", "--steps", "4")

pytestmark = [
    pytest.mark.skipif(
        os.environ.get("DS_MULTINODE") != "1",
        reason="multi-node tests change this machine (namespaces, /etc/hosts, sshd): "
        "run them with `nox -s multinode` (or DS_MULTINODE=1 as root)",
    ),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: network namespaces and sshd"),
]


def _free_port() -> int:
    """A free port below the kernel's ephemeral range (32768-60999).

    A port the kernel hands out for `bind(0)` lies in the ephemeral range, which srun and sshd draw
    their own sockets from at launch time on node0: one CI run lost the rendezvous to srun's I/O socket
    on the same port (rank 0's store "failed to recv, got 0 bytes"). Below the range only a listener
    started on purpose can hold the port.
    """
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200):
        port = rng.randrange(20000, 32768)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32767")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CONTRACT}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    return env


@pytest.fixture(scope="module")
def hostfile() -> Iterator[Path]:
    """`hosts.sh up 2` for the module; `hosts.sh down` always runs after it (and first, for leftovers)."""
    subprocess.run([str(HOSTS_SH), "down"], capture_output=True, timeout=120, check=False)
    try:
        up = subprocess.run([str(HOSTS_SH), "up", "2"], capture_output=True, text=True, timeout=900)
        assert up.returncode == 0, f"hosts.sh up 2 failed:\n{up.stdout}\n{up.stderr}"
        yield Path(up.stdout.strip().splitlines()[-1])
    finally:
        down = subprocess.run([str(HOSTS_SH), "down"], capture_output=True, text=True, timeout=120)
        assert down.returncode == 0, f"hosts.sh down failed:\n{down.stdout}\n{down.stderr}"


@pytest.fixture(scope="module")
def slurm_conf(hostfile: Path) -> Path:
    """`hosts.sh slurm`: slurmctld on node0, slurmd on node0 and node1 (stopped by the hosts' `down`)."""
    up = subprocess.run([str(HOSTS_SH), "slurm"], capture_output=True, text=True, timeout=900)
    assert up.returncode == 0, f"hosts.sh slurm failed:\n{up.stdout}\n{up.stderr}"
    return Path(up.stdout.strip().splitlines()[-1])


def _runner_env(request: pytest.FixtureRequest, runner: str) -> dict[str, str]:
    """The launcher's environment; srun and sinfo find the cluster through SLURM_CONF."""
    if runner == "slurm":
        return _env(SLURM_CONF=str(request.getfixturevalue("slurm_conf")))
    return _env()


@dataclass
class Run:
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path
    started: float
    returncode: int | None = None
    ended: float = 0.0

    @property
    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    @property
    def stderr(self) -> str:
        return self.err.read_text(errors="replace")

    def reports(self, event: str) -> dict[int, dict]:
        """The ranks' JSON lines of one event by rank (pdsh prefixes each line with `host: `)."""
        found = {}
        for line in self.stdout.splitlines():
            text = line[line.find("{") :] if "{" in line else ""
            if text:
                record = json.loads(text)
                if record.get("event") == event:
                    found[record["rank"]] = record
        return found

    def wait(self, timeout: float) -> Run:
        try:
            self.returncode = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            pytest.fail(
                f"launcher still running after {timeout}s\n--- stdout\n{self.stdout[-3000:]}\n"
                f"--- stderr\n{self.stderr[-5000:]}"
            )
        self.ended = time.monotonic()
        return self

    def wait_reports(self, event: str, count: int, timeout: float) -> dict[int, dict]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = self.reports(event)
            if len(found) >= count:
                return found
            time.sleep(0.2)
        pytest.fail(
            f"not {count} {event!r} reports within {timeout}s\n--- stdout\n{self.stdout[-3000:]}\n"
            f"--- stderr\n{self.stderr[-5000:]}"
        )

    def output(self) -> str:
        return f"--- stdout\n{self.stdout[-3000:]}\n--- stderr\n{self.stderr[-6000:]}"


class Launcher:
    """Starts `deepspeed` (python -m ds_launcher) on a node; every launch it made is killed at teardown."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.runs: list[Run] = []

    def start(self, *args: str, node: str = "node0", env: dict[str, str] | None = None) -> Run:
        n = len(self.runs)
        out, err = self.tmp_path / f"launch{n}.out", self.tmp_path / f"launch{n}.err"
        argv = [str(HOSTS_SH), "exec", node, sys.executable, "-m", "ds_launcher", *args]
        with open(out, "wb") as o, open(err, "wb") as e:
            # `hosts.sh exec` ends in exec nsenter, which execs python: the pid is the launcher's.
            proc = subprocess.Popen(
                argv, cwd=self.tmp_path, env=env or _env(), stdout=o, stderr=e, start_new_session=True
            )
        run = Run(proc, out, err, time.monotonic())
        self.runs.append(run)
        return run

    def run(self, *args: str, timeout: float = 180, **kwargs: object) -> Run:
        return self.start(*args, **kwargs).wait(timeout)  # type: ignore[arg-type]


@pytest.fixture
def launcher(hostfile: Path, tmp_path: Path) -> Iterator[Launcher]:
    launch = Launcher(tmp_path)
    yield launch
    for run in launch.runs:
        if run.proc.poll() is None:
            os.killpg(run.proc.pid, signal.SIGKILL)
            run.proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rindex(b")") + 2 :].split()[0] != b"Z"


def _job_processes(port: int) -> list[str]:
    """Command lines of this job's processes still alive on any host (the hosts share one pid space)."""
    ps = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
    return [line for line in ps.splitlines() if f"--master_port={port}" in line or f"MASTER_PORT={port}" in line]


def _assert_all_gone(pids: list[int], port: int, within: float) -> None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and (any(map(_alive, pids)) or _job_processes(port)):
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], f"ranks still alive {within}s after the launcher ended"
    assert not _job_processes(port), f"job processes left: {_job_processes(port)}"


# ---------------------------------------------------------------------------------------------------- training


def _losses(log: Path) -> list[float]:
    entries = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    return [e["loss"] for e in sorted(entries, key=lambda e: e["step"]) if "loss" in e]


@pytest.fixture(scope="module")
def one_node_losses(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    """Rank 0's per-step losses of train_gpt.py on 1 node x 4 ranks (this host, no hostfile)."""
    tmp = tmp_path_factory.mktemp("one_node")
    log = tmp / "losses.jsonl"
    argv = [
        sys.executable,
        "-m",
        "ds_launcher",
        "--num_gpus",
        "4",
        "--master_port",
        str(_free_port()),
        str(TRAIN_GPT),
        *GPT_ARGS,
        "--log_json",
        str(log),
        "--save_dir",
        str(tmp / "ckpt"),
    ]
    done = subprocess.run(argv, cwd=tmp, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"1 x 4 reference run failed\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    losses = _losses(log)
    assert len(losses) == 4
    return losses


@pytest.mark.timeout(420)
@pytest.mark.parametrize("runner", ["pdsh", "ssh", "openmpi", "slurm"])
def test_two_nodes_train_like_one(
    request: pytest.FixtureRequest, launcher: Launcher, hostfile: Path, one_node_losses: list[float], runner: str
) -> None:
    log = launcher.tmp_path / "losses.jsonl"
    run = launcher.run(
        "--hostfile",
        str(hostfile),
        "--launcher",
        runner,
        "--master_port",
        str(_free_port()),
        str(TRAIN_GPT),
        *GPT_ARGS,
        "--log_json",
        str(log),
        "--save_dir",
        str(launcher.tmp_path / "ckpt"),
        env=_runner_env(request, runner),
    )
    assert run.returncode == 0, run.output()
    assert "world 4" in run.stdout, run.output()
    torch.testing.assert_close(
        torch.tensor(_losses(log), dtype=torch.float64),
        torch.tensor(one_node_losses, dtype=torch.float64),
        rtol=1e-5,
        atol=0.0,
    )


# ----------------------------------------------------------------------------------------- selection and environment


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("flags", "hosts"),
    [(("--include", "node1"), ["node1", "node1"]), (("--exclude", "node0:1"), ["node0", "node1", "node1"])],
    ids=["include-node1", "exclude-node0-slot1"],
)
def test_include_exclude_across_hosts(
    launcher: Launcher, hostfile: Path, flags: tuple[str, str], hosts: list[str]
) -> None:
    run = launcher.run(
        "--hostfile", str(hostfile), *flags, "--master_port", str(_free_port()), str(JOB), "--steps", "1"
    )
    assert run.returncode == 0, run.output()
    ready = run.reports("ready")
    assert [ready[r]["host"] for r in sorted(ready)] == hosts
    assert {r["world"] for r in ready.values()} == {len(hosts)}
    assert sorted(run.reports("done")) == list(range(len(hosts)))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("runner", ["pdsh", "ssh"])
def test_env_file_pythonpath_master_addr_and_ssh_port(launcher: Launcher, hostfile: Path, runner: str) -> None:
    """Launched from node1: the master address (node0's, first in the hostfile) must come through ssh."""
    value = "two words, 'quoted' $HOME `id`"
    (launcher.tmp_path / ".deepspeed_env").write_text(f"DSMN_FROM_ENV_FILE={value}\n")
    probe = launcher.tmp_path / "probe"
    probe.mkdir()
    (probe / "dsmn_probe.py").write_text("VALUE = 'imported through PYTHONPATH'\n")
    pythonpath = os.pathsep.join(p for p in (str(probe), os.environ.get("PYTHONPATH", "")) if p)
    run = launcher.run(
        "--hostfile",
        str(hostfile),
        "--launcher",
        runner,
        "--ssh_port",
        "2222",
        "--master_port",
        str(_free_port()),
        str(JOB),
        "--steps",
        "1",
        "--import_probe",
        "--report_env",
        "DSMN_FROM_ENV_FILE",
        "MASTER_ADDR",
        node="node1",
        env=_env(PYTHONPATH=pythonpath),
    )
    assert run.returncode == 0, run.output()
    ready = run.reports("ready")
    assert [ready[r]["host"] for r in range(4)] == ["node0", "node0", "node1", "node1"]
    for record in ready.values():
        assert record["env"] == {"DSMN_FROM_ENV_FILE": value, "MASTER_ADDR": NODE0_ADDR}
        assert record["probe"] == "imported through PYTHONPATH"
        # sshd sets SSH_CONNECTION="client port server port": every node launcher came in through 2222.
        assert record["ssh"] is not None and record["ssh"].split()[3] == "2222", record["ssh"]


# ---------------------------------------------------------------------------------------------------- failures

#: A remote rank's failure must end the whole job within this many seconds.
FAILURE_DEADLINE_S = 30.0


@pytest.mark.timeout(240)
@pytest.mark.parametrize("runner", ["pdsh", "ssh", "slurm"])
@pytest.mark.parametrize("fail_step", [2, 0], ids=["in-a-collective", "while-others-sleep"])
def test_remote_rank_failure_ends_the_job(
    request: pytest.FixtureRequest, launcher: Launcher, hostfile: Path, runner: str, fail_step: int
) -> None:
    port = _free_port()
    run = launcher.run(
        "--hostfile",
        str(hostfile),
        "--launcher",
        runner,
        "--master_port",
        str(port),
        str(JOB),
        "--steps",
        "5",
        "--fail_rank",
        "3",
        "--fail_step",
        str(fail_step),
        env=_runner_env(request, runner),
    )
    ended = time.time()
    assert run.returncode == 1, run.output()
    failing = run.reports("failing")
    assert list(failing) == [3], run.output()
    took = ended - failing[3]["t"]
    print(f"{runner} fail_step={fail_step}: job ended {took:.1f}s after rank 3 raised")
    assert took < FAILURE_DEADLINE_S, run.output()
    both = run.stdout + run.stderr
    assert "Traceback (most recent call last)" in both and "RuntimeError: injected failure on rank 3" in both
    _assert_all_gone([r["pid"] for r in run.reports("ready").values()], port, within=10)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("runner", ["pdsh", "ssh", "slurm"])
def test_signal_to_the_launcher_ends_every_rank(
    request: pytest.FixtureRequest, launcher: Launcher, hostfile: Path, runner: str, sig: signal.Signals
) -> None:
    port = _free_port()
    run = launcher.start(
        "--hostfile",
        str(hostfile),
        "--launcher",
        runner,
        "--master_port",
        str(port),
        str(JOB),
        "--hang",
        env=_runner_env(request, runner),
    )
    ready = run.wait_reports("ready", 4, timeout=180)
    assert {r["host"] for r in ready.values()} == {"node0", "node1"}
    sent = time.monotonic()
    run.proc.send_signal(sig)
    run.wait(timeout=60)
    print(f"{runner} {sig.name}: launcher exited {run.ended - sent:.1f}s after the signal")
    assert run.returncode == 128 + sig, run.output()
    _assert_all_gone([r["pid"] for r in ready.values()], port, within=15)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("runner", ["pdsh", "ssh", "openmpi"])
def test_unreachable_host_fails_fast_before_any_rank(launcher: Launcher, hostfile: Path, runner: str) -> None:
    bad = launcher.tmp_path / "hostfile"
    bad.write_text(hostfile.read_text() + f"{UNREACHABLE} slots=2\n")
    run = launcher.run(
        "--hostfile", str(bad), "--launcher", runner, "--master_port", str(_free_port()), str(JOB), timeout=60
    )
    took = run.ended - run.started
    print(f"{runner}: refused the unreachable host after {took:.1f}s")
    assert run.returncode == 2, run.output()
    assert f"{UNREACHABLE} (" in run.stderr and "not reachable by passwordless ssh" in run.stderr, run.output()
    assert "node0 (" not in run.stderr and "node1 (" not in run.stderr  # only the bad host is named
    assert not run.reports("ready") and "ds_launcher.launch" not in run.stderr, run.output()
    assert took < 25, run.output()
