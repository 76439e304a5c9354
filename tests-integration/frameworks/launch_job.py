"""Start a 2-rank framework job with torchrun or the `deepspeed` launcher; fail with its output.

One retry, only for a job whose rank died of SIGABRT with "terminate called without an active
exception": gloo's worker threads can abort a process that is finishing (see `ds_comm._exit_teardown`;
torch alone shows it in about 1 of 15 2-rank runs). The jobs destroy their process groups before exit,
which makes it rare, but a framework may still hold a group of its own. Any other failure fails at once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from conftest import free_port

ABORT_AT_EXIT = "terminate called without an active exception"


def _run(cmd: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """`cmd` in its own session; past `timeout` the launcher *and its ranks* are killed and the output so far shown."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"{' '.join(cmd)} did not finish in {timeout:.0f} s\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-6000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def launch(script: Path, *args: str, launcher: str = "torchrun", timeout: float = 240) -> None:
    """Run `script args` on 2 ranks through `launcher` ("torchrun" or "deepspeed", ds's launcher).

    `timeout` bounds each attempt; keep the test's own timeout above two attempts.
    """
    if launcher == "torchrun":
        head = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    elif launcher == "deepspeed":
        head = [sys.executable, "-m", "ds_launcher", "--num_gpus", "2"]
    else:
        raise ValueError(f"launcher must be 'torchrun' or 'deepspeed', got {launcher!r}")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for attempt in (1, 2):
        cmd = [*head, "--master_port", str(free_port()), str(script), *args]
        proc = _run(cmd, env, timeout)
        if proc.returncode == 0:
            return
        if attempt == 2 or ABORT_AT_EXIT not in proc.stderr:
            break
        print(f"retrying once after a SIGABRT at exit: {' '.join(cmd)}", file=sys.stderr)
    raise AssertionError(
        f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n"
        f"--- stderr\n{proc.stderr[-6000:]}"
    )
