"""Hostfiles: `hostname slots=N` lines into an ordered `{host: slots}` resource pool.

The grammar is DeepSpeed's (and MPI's): one host per line, `slots=N` after the name, `#` starts a
comment, blank lines are skipped. Extra `key=value` attributes after the slot count (OpenMPI's
`max_slots=8`) are accepted and ignored. Every error names the file and the line number, because
a hostfile is usually edited by hand on a login node far from where the error shows up.
"""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

#: Where DeepSpeed (and DLTS clusters) look when no `--hostfile` is given.
DEFAULT_HOSTFILE = "/job/hostfile"

_HOST = re.compile(r"^[A-Za-z0-9_.:\[\]%-]+$")
_ATTRIBUTE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=\S*$")


class HostfileError(ValueError):
    """A hostfile that cannot be used; the message names the file, the line and the fix."""


def _parse_line(line: str, where: str) -> tuple[str, int]:
    """`worker-0 slots=4 [key=value ...]` (comment already removed) into `(host, slots)`."""
    expected = "expected 'hostname slots=N', e.g. 'worker-0 slots=4'"
    tokens = line.split()
    host = tokens[0]
    if not _HOST.match(host) or "=" in host:
        raise HostfileError(f"{where}: bad host name {host!r}; {expected}")
    if len(tokens) < 2 or not tokens[1].startswith("slots="):
        raise HostfileError(f"{where}: {line!r} has no slot count; {expected}")
    value = tokens[1][len("slots=") :]
    if not re.fullmatch(r"[0-9]+", value):
        raise HostfileError(f"{where}: slot count {value!r} of host {host!r} is not a whole number; {expected}")
    slots = int(value)
    if slots < 1:
        raise HostfileError(f"{where}: host {host!r} has slots={slots}; give at least 1 slot or remove the line")
    for extra in tokens[2:]:
        if not _ATTRIBUTE.match(extra):
            raise HostfileError(f"{where}: unexpected {extra!r} after the slot count; {expected}")
    return host, slots


def parse_hostfile(text: str, source: str = "<hostfile>") -> dict[str, int]:
    """Parse hostfile text into `{host: slots}` in file order.

    Args:
        text: the hostfile's contents.
        source: the name used in error messages (the file's path).

    Returns:
        An insertion-ordered dict: host name to its number of slots (devices or CPU ranks).

    Raises:
        HostfileError: a malformed line, a slot count that is not a positive integer, a host listed
            twice, or no hosts at all. The message has the form `path:line: problem; fix`.
    """
    pool: dict[str, int] = {}
    first_seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source}:{lineno}"
        host, slots = _parse_line(line, where)
        if host in pool:
            raise HostfileError(
                f"{where}: host {host!r} is already listed on line {first_seen[host]}; "
                "list each host once with its total slot count"
            )
        pool[host] = slots
        first_seen[host] = lineno
    if not pool:
        raise HostfileError(f"{source}: no hosts found; expected lines like 'worker-0 slots=4'")
    return pool


def fetch_hostfile(path: str | None) -> dict[str, int] | None:
    """Read the resource pool from `path`, or from `/job/hostfile` when `path` is None.

    Args:
        path: the `--hostfile` argument; None means the user gave none.

    Returns:
        The pool, or None when no hostfile was given and `/job/hostfile` does not exist
        (the launch then uses this host's local devices only).

    Raises:
        HostfileError: the given file does not exist (a typo should not silently turn a
            multi-node job into a single-node one), is a directory, or does not parse.
    """
    if path is None:
        if not os.path.isfile(DEFAULT_HOSTFILE):
            logger.info("no hostfile at %s: using this host's local resources only", DEFAULT_HOSTFILE)
            return None
        path = DEFAULT_HOSTFILE
    if not os.path.exists(path):
        raise HostfileError(
            f"--hostfile {path!r} does not exist; pass an existing file, or omit --hostfile "
            "to use this host's local resources"
        )
    if os.path.isdir(path):
        raise HostfileError(f"--hostfile {path!r} is a directory; pass the hostfile itself")
    with open(path, encoding="utf-8") as f:
        return parse_hostfile(f.read(), source=path)
