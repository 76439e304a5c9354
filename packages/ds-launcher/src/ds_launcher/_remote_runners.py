"""Runners that start `ds_launcher.launch` on each host through a remote shell: pdsh and plain ssh."""

from __future__ import annotations

import re
import shlex

from ds_launcher._runner_base import Command, MultiNodeRunner, launch_pattern, remote_shell_command

#: pdsh's fan-out (hosts contacted at once).
PDSH_FANOUT = 1024


#: pdsh's line when one host's remote command ended badly: `pdsh@node0: node1: ssh exited with exit code 1`.
_PDSH_HOST_FAILED = re.compile(r"^pdsh@\S+: (\S+): \S+ exited with exit code (\d+)")


def pdsh_host_failure(line: str) -> int | None:
    """The exit status in pdsh's report of a host whose command failed, or None for any other line.

    pdsh itself exits only when every host's command has ended, so one node's launcher failing
    (its rank died) would leave the other nodes' ranks running until they notice; the runner
    watches pdsh's stderr for this line and ends the job at once instead.
    """
    match = _PDSH_HOST_FAILED.match(line)
    return (int(match.group(2)) or None) if match else None


def _kill_line(pattern: str) -> str:
    return f"pkill -TERM -f -- {shlex.quote(pattern)}"


class PDSHRunner(MultiNodeRunner):
    """`pdsh -S -f 1024 -w host,... '<cd && export ... && exec launch --node_rank=%n ...>'`.

    pdsh replaces `%n` with each host's index in the `-w` list, which is the node rank, and `-S`
    makes pdsh exit with the largest remote exit status.
    """

    name = "pdsh"
    tool = "pdsh"
    provider = "pdsh (apt-get install pdsh, yum install pdsh)"

    def _base(self) -> list[str]:
        return ["pdsh", "-S", "-f", str(PDSH_FANOUT), "-w", ",".join(self.plan.hosts)]

    def _env(self) -> dict[str, str]:
        env = {"PDSH_RCMD_TYPE": "ssh"}
        if self.plan.ssh_port is not None:
            env["PDSH_SSH_ARGS_APPEND"] = f"-p {self.plan.ssh_port}"
        return env

    def commands(self, exports: dict[str, str]) -> list[Command]:
        remote = remote_shell_command(self.plan, exports, "%n")
        return [
            Command(
                "pdsh", [*self._base(), *self.plan.launcher_args, remote], self._env(), stderr_watch=pdsh_host_failure
            )
        ]

    def kill_commands(self) -> list[list[str]]:
        return [[*self._base(), _kill_line(launch_pattern(self.plan))]]

    def kill_env(self) -> dict[str, str]:
        return self._env()


class SSHRunner(MultiNodeRunner):
    """One `ssh [-p port] [launcher_args] host '<cd && export ... && exec launch --node_rank=i ...>'` per host.

    The runner supervises the ssh clients like ranks: the first one to fail ends the others, and
    on the way out each host gets `pkill -TERM -f <this job's launcher>` (closing an ssh session
    without a terminal does not stop the remote command).
    """

    name = "ssh"
    tool = "ssh"
    provider = "an OpenSSH client (apt-get install openssh-client)"

    def _ssh(self, host: str) -> list[str]:
        port = ["-p", str(self.plan.ssh_port)] if self.plan.ssh_port is not None else []
        return ["ssh", *port, *self.plan.launcher_args, host]

    def commands(self, exports: dict[str, str]) -> list[Command]:
        return [
            Command(f"ssh {host} (node {rank})", [*self._ssh(host), remote_shell_command(self.plan, exports, rank)])
            for rank, host in enumerate(self.plan.hosts)
        ]

    def kill_commands(self) -> list[list[str]]:
        line = _kill_line(launch_pattern(self.plan))
        return [[*self._ssh(host), line] for host in self.plan.hosts]
