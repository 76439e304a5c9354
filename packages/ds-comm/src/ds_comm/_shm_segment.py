"""What ds_comm's shared-memory transports share: the segment file, futex waits, the switch.

Two transports map a segment between two processes of one host: `ds_comm._shm_pair` (a two-rank
group's collectives) and `ds_comm._shm_p2p` (point-to-point sends between two ranks that asked for it).
Each lays out its own header and slots; here is only what they have in common.

[Note: the segment file] The lower rank creates `/dev/shm/ds_comm_<kind>_<pid>_<nonce>` with its space
reserved up front (`posix_fallocate`: a full /dev/shm refuses here instead of killing a process with
SIGBUS later) and writes the nonce into the first 8 bytes; the peer maps it and checks the size and the
nonce (the same /dev/shm, not only the same host name); then the creator unlinks the name, so the memory
lives only as long as the two mappings and nothing is left behind when a rank crashes.

[Note: counters] Counters are 32-bit words that only one process writes, published with plain aligned
stores after the data they announce. x86's store order makes them visible in that order, so the
transports run only on x86-64 Linux; other CPUs would need barriers Python cannot issue and keep gloo.
Waits sleep on the word's futex (the shared, not the private, variant), so a waiting rank burns no CPU.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import platform
import secrets
import sys
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)

ENV = "DS_COMM_SHM"
"""Set to 0 (or false/off/no) on any rank to keep its pair exchanges and p2p sends on gloo."""

MASK, HALF = 0xFFFFFFFF, 0x80000000
POLL_S = 0.5  # how often a sleeping waiter looks whether its peer is still there
WAKE_ALL = 0x7FFFFFFF

_SYS_FUTEX = 202  # x86-64
FUTEX_WAIT, FUTEX_WAKE = 0, 1  # not the private variants: the word is shared between processes


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall: Any = None


def futex(addr: int, op: int, val: int, timeout_s: float | None = None) -> None:
    """FUTEX_WAIT (sleep while the word at `addr` holds `val`, up to `timeout_s`) or FUTEX_WAKE."""
    global _syscall
    if _syscall is None:
        _syscall = ctypes.CDLL(None, use_errno=True).syscall  # releases the GIL while it sleeps
        _syscall.restype = ctypes.c_long
    ts = None
    if timeout_s is not None:
        whole = int(timeout_s)
        ts = ctypes.byref(_Timespec(whole, int((timeout_s - whole) * 1e9)))
    _syscall(ctypes.c_long(_SYS_FUTEX), ctypes.c_void_p(addr), ctypes.c_int(op), ctypes.c_int(val), ts, None, 0)


def reached(value: int, target: int) -> bool:
    """Counter `value` is at or past `target` (both modulo 2**32; they are never 2**31 apart)."""
    return ((value - target) & MASK) < HALF


def enabled() -> bool:
    """Whether this rank may use a shared segment at all (the switch, the platform, /dev/shm)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    return sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64") and os.path.isdir("/dev/shm")


def pid_ns() -> int:
    """This process's pid namespace (-1 if unknown): a peer's pid means something here only in the same one."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return -1


def path(kind: str, pid: int, nonce: int) -> str:
    return f"/dev/shm/ds_comm_{kind}_{pid}_{nonce:016x}"


def create(kind: str, size: int) -> tuple[mmap.mmap, str, int] | None:
    """A new segment of `size` bytes with its nonce written: (mapping, path, nonce), or None (logged)."""
    nonce = secrets.randbits(63)
    where = path(kind, os.getpid(), nonce)
    try:
        fd = os.open(where, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        logger.info("no shared-memory segment for a %s (%s): gloo carries it", kind, err)
        return None
    try:
        os.posix_fallocate(fd, 0, size)  # the space is taken now or refused now, never a SIGBUS later
        mm = mmap.mmap(fd, size)
    except OSError as err:
        os.unlink(where)
        logger.info("no shared-memory segment for a %s (%s): gloo carries it", kind, err)
        return None
    finally:
        os.close(fd)
    torch.frombuffer(mm, dtype=torch.int64, count=1)[0] = nonce
    return mm, where, nonce


def attach(kind: str, pid: int, nonce: int, size: int) -> mmap.mmap | None:
    """The peer's segment, or None where it is not this /dev/shm's (another container or host)."""
    try:
        fd = os.open(path(kind, pid, nonce), os.O_RDWR)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size != size:
            return None
        mm = mmap.mmap(fd, size)
    except OSError:
        return None
    finally:
        os.close(fd)
    if int(torch.frombuffer(mm, dtype=torch.int64, count=1)[0]) != nonce:
        close(mm)
        return None
    return mm


def unlink(where: str) -> None:
    try:
        os.unlink(where)
    except FileNotFoundError:
        pass


def close(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a tensor still views it: the mapping goes with the last one
        pass


def check_peer(pid: int | None, what: str) -> None:
    """Raise if the peer process `pid` (None: not checkable) has exited; `what` names the transport."""
    if pid is None:
        return
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        raise RuntimeError(f"{what}: the peer process (pid {pid}) has exited") from None
    except PermissionError:
        pass


def timeout_seconds(timeout: timedelta | None) -> float:
    """A wait's limit: `timeout`, else the collectives' configured timeout (30 minutes before any)."""
    if timeout is not None:
        return timeout.total_seconds()
    from ds_comm._dist_init import state

    return state.timeout.total_seconds() if state.timeout is not None else 1800.0


def completed_future() -> torch.futures.Future[list[torch.Tensor]]:
    """What `get_future()` of a finished work returns: a future already set (the data is in place)."""
    fut: torch.futures.Future[list[torch.Tensor]] = torch.futures.Future()
    fut.set_result([])
    return fut


_all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch 2.13's name, else the old


def pair_rows(values: list[int], group: ProcessGroup | None) -> tuple[list[int], list[int]]:
    """Both ranks' `values` of a two-rank `group`, (rank 0's, rank 1's): the facts a setup decides from, the
    same on both ranks (one all-gather; both ranks call it with as many values)."""
    rows = torch.empty(2 * len(values), dtype=torch.int64)
    _all_gather(rows, torch.tensor(values, dtype=torch.int64), group=group)
    first, second = rows.view(2, len(values)).tolist()
    return first, second
