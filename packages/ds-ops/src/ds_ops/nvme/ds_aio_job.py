"""`deepspeed.nvme.ds_aio_job`: a shell command with its output sent to a file (DeepSpeed's `Job`, `run_job`).

DeepSpeed's sweep tools describe each `ds_io` run as a `Job` and run it with `run_job`, which fails when the
command does. Here the failure is a `RuntimeError` naming the command, its exit status and where its output
went (DeepSpeed asserts).
"""

from __future__ import annotations

import shlex
import subprocess
from typing import IO, Any

__all__ = ["Job", "run_job"]


class Job:
    """A command line (a list of words, or one string) whose output goes to `output_file` (None: inherited)."""

    def __init__(self, cmd_line: list[str] | str, output_file: str | None = None, work_dir: str | None = None) -> None:
        self.cmd_line = cmd_line
        self.output_file = output_file
        self.work_dir = work_dir
        self.output_fd: IO[str] | None = None

    def cmd(self) -> list[str] | str:
        return self.cmd_line

    def get_stdout(self) -> IO[str] | None:
        return self.output_fd

    def get_stderr(self) -> IO[str] | None:
        return self.output_fd

    def get_cwd(self) -> str | None:
        return self.work_dir

    def open_output_file(self) -> None:
        if self.output_file is not None:
            self.output_fd = open(self.output_file, "w")  # noqa: SIM115 - closed by close_output_file

    def close_output_file(self) -> None:
        if self.output_fd is not None:
            self.output_fd.close()
            self.output_fd = None


def run_job(job: Job, verbose: bool = False) -> None:
    """Run `job` to completion (its words joined and split as a shell would, without a shell).

    Raises:
        RuntimeError: the command exited with a non-zero status.
    """
    line = job.cmd()
    argv = shlex.split(line if isinstance(line, str) else " ".join(line))
    if verbose:
        print(f"args = {argv}")
    job.open_output_file()
    try:
        kwargs: dict[str, Any] = {"stdout": job.get_stdout(), "stderr": job.get_stderr(), "cwd": job.get_cwd()}
        proc = subprocess.run(argv, check=False, **kwargs)
    finally:
        job.close_output_file()
    if proc.returncode != 0:
        where = f"; its output is in {job.output_file}" if job.output_file else ""
        raise RuntimeError(f"this command failed with exit status {proc.returncode}: {' '.join(argv)}{where}")
