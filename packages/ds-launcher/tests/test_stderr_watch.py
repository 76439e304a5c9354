"""A runner whose backend reports one host's failure on stderr before exiting (pdsh) ends the job at once."""

from __future__ import annotations

import sys
import time

import pytest

from ds_launcher._procs import Supervisor
from ds_launcher._remote_runners import pdsh_host_failure

#: Prints pdsh's report of a failed host, then keeps running as pdsh does while other hosts are busy.
PDSH_LIKE = (
    "import sys, time; sys.stderr.write('node1: Traceback...\\n');"
    "sys.stderr.write('pdsh@node0: node1: ssh exited with exit code 3\\n'); sys.stderr.flush();"
    "time.sleep(60)"
)


def test_pdsh_failure_line() -> None:
    assert pdsh_host_failure("pdsh@node0: node1: ssh exited with exit code 3\n") == 3
    assert pdsh_host_failure("pdsh@node0: worker-7.cluster: ssh exited with exit code 255") == 255
    assert pdsh_host_failure("pdsh@node0: node1: ssh exited with exit code 0") is None
    assert pdsh_host_failure("node1: pdsh@node0: node1: ssh exited with exit code 3") is None  # a rank's output
    assert pdsh_host_failure("node1: some output") is None


@pytest.mark.timeout(60)
def test_watched_failure_ends_the_job_with_its_status(capfd: pytest.CaptureFixture[str]) -> None:
    terminated = []
    supervisor = Supervisor(grace_s=2.0, on_terminate=lambda: terminated.append(time.monotonic()))
    start = time.monotonic()
    proc = supervisor.start("pdsh", [sys.executable, "-c", PDSH_LIKE], env={}, stderr_watch=pdsh_host_failure)
    assert supervisor.run() == 3
    assert time.monotonic() - start < 20 and terminated, "the job did not end when a host failed"
    assert proc.poll() is not None
    err = capfd.readouterr().err
    assert "node1: Traceback" in err and "ssh exited with exit code 3" in err  # passed through


@pytest.mark.timeout(60)
def test_watched_process_that_succeeds_keeps_its_status(capfd: pytest.CaptureFixture[str]) -> None:
    supervisor = Supervisor()
    code = "import sys; sys.stderr.write('pdsh@n0: n1: ssh exited with exit code 0\\nbye\\n')"
    supervisor.start("pdsh", [sys.executable, "-c", code], env={}, stderr_watch=pdsh_host_failure)
    assert supervisor.run() == 0
    assert "bye" in capfd.readouterr().err


def test_srun_failure_line() -> None:
    from ds_launcher._slurm_runner import srun_task_failure

    assert srun_task_failure("srun: error: node1: task 3: Exited with exit code 1\n") == 1
    assert srun_task_failure("srun: error: node0: tasks 0-1: Exited with exit code 7") == 7
    assert srun_task_failure("srun: error: node0: tasks [0,2]: Exited with exit code 9") == 9
    assert srun_task_failure("srun: error: node0: tasks 0-1: Terminated") is None  # killed by srun: not the cause
    assert srun_task_failure("srun: error: node1: task 3: Exited with exit code 0") is None
