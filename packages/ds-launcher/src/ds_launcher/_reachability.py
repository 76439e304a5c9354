"""Before any rank starts: can every host of the job be reached by passwordless ssh?

A multi-node job whose last host is down would otherwise start its ranks on the hosts that answer,
which then wait in the rendezvous for ranks that never come, until a timeout far away. So the
runner asks every remote host at once (`ssh -o BatchMode=yes -o ConnectTimeout=S host true`) and
refuses to launch while any of them fails, naming each with ssh's own reason. Checking all hosts
concurrently bounds the check by one connect timeout, not one per host.
"""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable, Sequence

#: Seconds ssh may take to connect to a host before it counts as unreachable.
SSH_CONNECT_TIMEOUT_S = 10


class UnreachableHostError(RuntimeError):
    """One or more hosts did not answer passwordless ssh; the message names each and ssh's reason."""


def ssh_check_command(host: str, ssh_port: int | None, connect_timeout_s: int = SSH_CONNECT_TIMEOUT_S) -> list[str]:
    """`ssh -o BatchMode=yes -o ConnectTimeout=S [-p port] host true`: fails instead of asking for a password."""
    port = ["-p", str(ssh_port)] if ssh_port else []
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout_s}", *port, host, "true"]


def check_hosts_reachable(
    hosts: Sequence[str],
    ssh_port: int | None,
    *,
    connect_timeout_s: int = SSH_CONNECT_TIMEOUT_S,
    is_local: Callable[[str], bool] = lambda host: False,
) -> None:
    """Raise `UnreachableHostError` unless every host in `hosts` (but local ones) answers ssh.

    Args:
        hosts: the job's hosts, in hostfile order.
        ssh_port: the `--ssh_port` value, or None for ssh's default.
        connect_timeout_s: ssh's ConnectTimeout; the whole check ends within about this plus the
            time the slowest host takes to run `true`.
        is_local: hosts for which this returns True are not checked (this machine).
    """
    remote = [host for host in dict.fromkeys(hosts) if not is_local(host)]
    procs = {
        host: subprocess.Popen(
            ssh_check_command(host, ssh_port, connect_timeout_s),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for host in remote
    }
    deadline = time.monotonic() + connect_timeout_s + 20
    failures: list[str] = []
    for host, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            failures.append(f"{host} (no answer within {connect_timeout_s + 20} s)")
            continue
        if proc.returncode != 0:
            reason = (err.strip().splitlines() or [f"ssh exited with {proc.returncode}"])[-1]
            failures.append(f"{host} ({reason})")
    if failures:
        example = shlex.join(ssh_check_command(remote[0], ssh_port, connect_timeout_s))
        raise UnreachableHostError(
            f"{len(failures)} host(s) not reachable by passwordless ssh: {'; '.join(failures)}. Nothing was "
            f"started. Check each with e.g. `{example}`, fix its keys or remove it from the hostfile "
            "(or --exclude it); --no_ssh_check skips this check"
        )
