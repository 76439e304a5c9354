"""Torch-free worker for the signal and supervision tests: report, optionally start a detached grandchild,
then wait (or exit with a code). Records the signals it receives in `--signal_dir`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--local_rank", type=int, default=None)
    p.add_argument("--spawn_child", action="store_true", help="start `sleep 300` in a new session")
    p.add_argument("--exit_rank", type=int, default=-1, help="this rank exits with --exit_code after reporting")
    p.add_argument("--exit_code", type=int, default=1)
    p.add_argument("--ignore_term", action="store_true", help="ignore SIGTERM (only SIGKILL ends this rank)")
    p.add_argument("--signal_dir", default=None, help="write <rank>.<SIGNAME> here when a signal arrives")
    args = p.parse_args()
    rank = int(os.environ["RANK"])

    def record(signum: int, _frame: object) -> None:
        if args.signal_dir:
            open(os.path.join(args.signal_dir, f"{rank}.{signal.Signals(signum).name}"), "w").close()
        sys.exit(128 + signum)

    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    elif args.signal_dir:
        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGINT, record)
    child = subprocess.Popen(["sleep", "300"], start_new_session=True).pid if args.spawn_child else None
    # one write() per line, so ranks sharing a stdout pipe never interleave within a line
    os.write(1, (json.dumps({"event": "ready", "rank": rank, "pid": os.getpid(), "child_pid": child}) + "\n").encode())
    if rank == args.exit_rank:
        time.sleep(0.3)
        sys.exit(args.exit_code)
    while True:
        time.sleep(0.2)


if __name__ == "__main__":
    main()
