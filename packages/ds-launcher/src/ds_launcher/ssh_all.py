"""`ds_ssh`: run one shell command on every host of a hostfile, through pdsh (or ssh, host by host).

    ds_ssh [-f HOSTFILE] COMMAND [ARGS...]

Hosts are the hostfile's host names in file order (comments and blank lines skipped, slots ignored);
the default hostfile is `/job/hostfile`, as for `deepspeed`. With pdsh on PATH the command runs on all
hosts at once (`PDSH_RCMD_TYPE=ssh pdsh -w h1,h2 COMMAND`), pdsh prefixing each output line with its
host; without pdsh each host is reached with `ssh HOST COMMAND` in turn. The exit status is pdsh's, or
the first non-zero status of the ssh runs.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence

from ds_launcher._hostfile import DEFAULT_HOSTFILE, HostfileError, parse_hostfile

__all__ = ["build_commands", "main"]


def build_commands(hosts: Sequence[str], command: Sequence[str], *, pdsh: str | None) -> list[list[str]]:
    """The command lines that run `command` on every host: one pdsh line, or one ssh line per host.

    Args:
        hosts: host names, in order.
        command: the command and its arguments, as typed after `ds_ssh`.
        pdsh: path of the pdsh executable, or None to use ssh.

    Raises:
        ValueError: no hosts or an empty command.
    """
    if not hosts:
        raise ValueError("ds_ssh: the hostfile lists no hosts")
    if not command:
        raise ValueError("ds_ssh: no command given; usage: ds_ssh [-f HOSTFILE] COMMAND [ARGS...]")
    remote = shlex.join(command)
    if pdsh is not None:
        return [[pdsh, "-w", ",".join(hosts), remote]]
    return [["ssh", host, remote] for host in hosts]


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="ds_ssh", description="Run a command on every host of a hostfile.")
    parser.add_argument("-f", "--hostfile", default=DEFAULT_HOSTFILE, help="hostfile (default %(default)s)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command to run on every host")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `ds_ssh`; returns the exit status."""
    args = _parse(argv)
    print(f"hostfile={args.hostfile}")
    try:
        with open(args.hostfile) as f:
            hosts = list(parse_hostfile(f.read(), source=args.hostfile))
        commands = build_commands(hosts, args.command, pdsh=shutil.which("pdsh"))
    except FileNotFoundError:
        print(f"ds_ssh: no hostfile at {args.hostfile}; pass one with -f", file=sys.stderr)
        return 1
    except (HostfileError, ValueError) as err:
        print(str(err), file=sys.stderr)
        return 1
    env = {**os.environ, "PDSH_RCMD_TYPE": "ssh"}
    status = 0
    for line in commands:
        code = subprocess.run(line, env=env, check=False).returncode
        status = status or code
    return status


if __name__ == "__main__":
    sys.exit(main())
