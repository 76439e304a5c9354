"""Point-to-point sends between two ranks of one host through a shared-memory ring instead of gloo's TCP.

[Note: why a ring for p2p] A pipeline moves an activation forward and a gradient back per micro-batch and
stage, and in 1F1B's steady state two such hops lie on the critical path of every micro-batch. Over gloo
a 4 KiB message between two ranks of a 2-core host took 95 us from the send to the completed receive
(the `isend` call alone 35 us: a socket write, then gloo's I/O thread and a condition variable on the
other side); through this ring, 36 us (the call 15 us): the sender copies into a slot of a segment both
processes map and rings the peer's futex. `benchmarks/pipe.py`'s compute-bound stages, 4 ranks on 2
CPUs, 4 paired rounds: a batch of 4 micro-batches took 24 ms against 30 ms over gloo (medians), one of
16 took 79 against 100 ms.

[Note: the link] `open_shm_p2p(peer)`, called by both ranks at the same point, sets up one segment per
pair (see ds_comm._shm_segment; the lower rank makes it, the two agree over gloo whether both mapped it):
a header page (nonce, slot size, slot count, then 32-bit counters on cache lines of their own: per
direction, messages written and messages taken out; per rank, a doorbell), then per direction `SLOTS`
slots of `SLOT_BYTES`, each with a 64-byte header (the message's byte size and its sequence number,
which the reader checks). From then on a send of at most `SLOT_BYTES` between the two, on the default
group with tag 0, takes the ring, whether issued by `isend`/`irecv`/`send`/`recv` or in a
`batch_isend_irecv`; anything else goes to gloo (torch.distributed's own calls always do: a linked pair
must not mix them with ds_comm's for such messages). Both sides decide from the message's byte size,
which a matching receive shares, so each transport stays in order on its own.

[Note: never blocking a send] gloo's `isend` returns at once, and programs rely on it: in a pipeline
step both neighbours send first and receive second. So a send that finds every slot unread is queued
(its bytes copied) instead of waiting, and queued sends go into the ring whenever this rank calls into
the link again: another send, or any wait (of a send, or of a receive, while it waits). A rank waits on
its own doorbell, which the peer rings after every slot it writes or takes out, so one wait covers both
"the peer wrote" and "the peer freed a slot". A queued send reaches the peer once its handle is waited
on (as torch's `isend` handles are), or at any later call on the link.

[Note: poll, then sleep] A process asleep on a futex on an idle core takes 0.1-0.3 ms to run again once
woken, on this kind of virtual machine (measured: about 0.2 ms after 5 ms idle, for gloo and for this
ring alike), about what gloo's whole hop costs. So where the local ranks' compute threads all have CPUs
of their own, a wait first polls for up to 1 ms (`DS_COMM_SHM_POLL_US`), yielding the core between
looks, and only then sleeps: a pipeline's steady-state hops are waited on for well under that, and the
long waits of filling and draining it cost 1 ms of polling each. With more threads than CPUs it does
not poll (measured on 2 CPUs with 4 compute-bound stages: polling made a batch 10% slower).

A receive posted early (`irecv`) queues its destination; its `wait()` takes the ring's messages out in
order up to it. Waits give up at the collective timeout with `TimeoutError`, and earlier with a
`RuntimeError` when the peer process is gone.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
import weakref
from collections import deque
from ctypes import memmove
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_comm._shm_segment import (
    FUTEX_WAIT,
    FUTEX_WAKE,
    MASK,
    POLL_S,
    WAKE_ALL,
    attach,
    check_peer,
    close,
    completed_future,
    create,
    enabled,
    futex,
    pid_ns,
    reached,
    timeout_seconds,
    unlink,
)

__all__ = [
    "POLL_ENV",
    "SLOTS",
    "SLOT_BYTES",
    "ShmLink",
    "ShmP2PWork",
    "open_shm_p2p",
    "poll_seconds",
    "shm_link",
    "shm_p2p_carries",
]

logger = logging.getLogger(__name__)

SLOT_BYTES = 256 * 1024
"""The largest message the ring carries; larger ones go through gloo (their copies cost more than its latency)."""
SLOTS = 8
"""Slots per direction: 2 MiB of shared memory each way per linked pair."""

POLL_ENV = "DS_COMM_SHM_POLL_US"
"""How long a p2p wait polls before it sleeps, in microseconds (see [Note: poll, then sleep])."""
DEFAULT_POLL_US = 1000.0

_HEADER = 4096
_SLOT_HEADER = 64
_SLOT_SIZE, _SLOT_COUNT = 1, 2  # header words (int64); word 0 is the nonce
_WRITTEN, _READ, _BELL = 64, 192, 320  # + 64 * index: per direction (written, read), per rank (bell)
_SETUP_TAG = 0x5D5
_WHAT = "shared-memory p2p"


def _segment_bytes(slot: int, slots: int) -> int:
    return _HEADER + 2 * slots * (_SLOT_HEADER + slot)


class ShmLink:
    """This rank's side of a linked pair: sends into its direction's slots, takes the peer's out in order.

    `low` is whether this rank is the pair's lower rank (direction 0 carries low -> high)."""

    def __init__(self, mm: mmap.mmap, low: bool, slot: int, slots: int, peer: int, peer_pid: int | None) -> None:
        self._mm = mm
        self._buf = torch.frombuffer(mm, dtype=torch.uint8)
        base = self._buf.data_ptr()
        self.peer, self.slot, self.slots = peer, slot, slots
        self._peer_pid = peer_pid
        out_dir, in_dir = (0, 1) if low else (1, 0)
        me, other = (0, 1) if low else (1, 0)

        def word(offset: int) -> tuple[ctypes.c_uint32, int]:
            return ctypes.c_uint32.from_address(base + offset), base + offset

        self._out_written, _ = word(_WRITTEN + 64 * out_dir)
        self._out_read, _ = word(_READ + 64 * out_dir)
        self._in_written, _ = word(_WRITTEN + 64 * in_dir)
        self._in_read, _ = word(_READ + 64 * in_dir)
        self._my_bell, self._my_bell_addr = word(_BELL + 64 * me)
        self._peer_bell, self._peer_bell_addr = word(_BELL + 64 * other)

        def ring(direction: int) -> list[tuple[int, ctypes.Array[ctypes.c_int64]]]:
            out = []
            for k in range(slots):
                at = base + _HEADER + (direction * slots + k) * (_SLOT_HEADER + slot)
                out.append((at + _SLOT_HEADER, (ctypes.c_int64 * 2).from_address(at)))
            return out

        self._out_slots, self._in_slots = ring(out_dir), ring(in_dir)
        self._assigned = 0  # sequence number of the last send issued (in the ring or queued)
        self._sent = 0  # ... and of the last one written into the ring
        self._queued: deque[torch.Tensor] = deque()  # bytes of sends issued but not yet in the ring
        self._posted = 0  # sequence number of the last receive posted
        self._taken = 0  # ... and of the last one taken out of the ring
        self._receives: deque[torch.Tensor] = deque()  # destinations of posted receives, in order
        self._lock = threading.Lock()
        self._broken: str | None = None
        self.messages_sent = self.messages_received = 0  # what took the ring, for tests and logs
        self.poll_s = poll_seconds()

    # ---- issuing -------------------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor) -> ShmP2PWork:
        """Put `tensor`'s bytes into the next slot, or queue them when every slot is unread."""
        address, size = _span(tensor)  # gloo's own check first: a strided tensor fails alike on either transport
        with self._lock:
            self._check()
            self._assigned += 1
            self._flush()
            if self._queued or not self._free():
                copy = torch.empty(size, dtype=torch.uint8)
                memmove(copy.data_ptr(), address, size)
                self._queued.append(copy)
            else:
                self._write(address, size)
            self.messages_sent += 1
            return ShmP2PWork(self, self._assigned, sending=True)

    def post(self, tensor: torch.Tensor) -> ShmP2PWork:
        """Queue `tensor` as the destination of the peer's next ring message (its byte size must match)."""
        _span(tensor)
        with self._lock:
            self._check()
            self._posted += 1
            self._receives.append(tensor)
            return ShmP2PWork(self, self._posted, sending=False)

    def _free(self) -> bool:
        return ((self._sent - self._out_read.value) & MASK) < self.slots

    def _write(self, address: int, size: int) -> None:
        self._sent += 1
        slot, head = self._out_slots[self._sent % self.slots]
        memmove(slot, address, size)
        head[0], head[1] = size, self._sent
        self._out_written.value = self._sent & MASK
        self._ring_peer()

    def _flush(self) -> None:
        while self._queued and self._free():
            data = self._queued.popleft()
            self._write(data.data_ptr(), data.numel())

    def _ring_peer(self) -> None:
        self._peer_bell.value = (self._peer_bell.value + 1) & MASK  # only this process writes the peer's bell
        futex(self._peer_bell_addr, FUTEX_WAKE, WAKE_ALL)

    # ---- receiving -----------------------------------------------------------------------------------

    def _take_out_arrived(self, upto: int) -> None:
        """Take out every message up to `upto` that the peer has written already."""
        while self._taken < upto and reached(self._in_written.value, (self._taken + 1) & MASK):
            seq = self._taken + 1
            dest = self._receives[0]
            slot, head = self._in_slots[seq % self.slots]
            size, theirs = head[0], head[1]
            address, want = _span(dest)
            if theirs != seq or size != want:
                raise RuntimeError(
                    f"{_WHAT} from rank {self.peer}: message {seq} holds {size} bytes where the receive "
                    f"expects {want} (a {tuple(dest.shape)} {dest.dtype} tensor); the two ranks' sends and "
                    "receives do not match"
                )
            memmove(address, slot, size)
            self._receives.popleft()
            self._taken = seq
            self.messages_received += 1
            self._in_read.value = seq & MASK
            self._ring_peer()

    def done(self, seq: int, sending: bool) -> bool:
        """Whether message `seq` is in the ring (a send) or in its destination (a receive); never waits."""
        with self._lock:
            self._check()
            self._progress(seq, sending)
            return (self._sent if sending else self._taken) >= seq

    def _progress(self, seq: int, sending: bool) -> None:
        try:
            self._flush()
            self._take_out_arrived(self._posted if sending else seq)
        except BaseException as err:
            self._broken = f"an earlier message failed: {err}"
            raise

    def wait(self, seq: int, sending: bool, timeout: timedelta | None) -> None:
        """Until message `seq` is sent or received, moving queued sends and arrived messages meanwhile."""
        now = time.monotonic()
        deadline, poll_until = now + timeout_seconds(timeout), now + self.poll_s
        with self._lock:
            self._check()
            while True:
                bell = self._my_bell.value  # read before looking, so a ring after the look ends the sleep
                self._progress(seq, sending)
                if (self._sent if sending else self._taken) >= seq:
                    return
                now = time.monotonic()
                if now < poll_until:  # [Note: poll, then sleep]
                    os.sched_yield()
                    continue
                left = deadline - now
                if left <= 0:
                    what = "take a slot out so that send" if sending else "write message"
                    self._broken = f"timed out waiting for rank {self.peer} to {what} {seq}"
                    raise TimeoutError(f"{_WHAT}: {self._broken}")
                try:
                    check_peer(self._peer_pid, _WHAT)
                except RuntimeError as err:
                    self._broken = str(err)
                    raise
                futex(self._my_bell_addr, FUTEX_WAIT, bell, min(left, POLL_S))

    def _check(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"{_WHAT} with rank {self.peer} unusable: {self._broken}")


class ShmP2PWork:
    """One send or receive through a link: `wait()` as on torch's p2p works."""

    __slots__ = ("_link", "_seq", "_sending", "_done")

    def __init__(self, link: ShmLink, seq: int, sending: bool) -> None:
        self._link, self._seq, self._sending = link, seq, sending
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            self._link.wait(self._seq, self._sending, timeout)
            self._done = True
        return True

    def is_completed(self) -> bool:
        if not self._done and self._link.done(self._seq, self._sending):
            self._done = True
        return self._done

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        self.wait()
        return completed_future()


def poll_seconds() -> float:
    """How long a wait polls: `DS_COMM_SHM_POLL_US` if set, else 1 ms where every compute thread of every
    local rank has a CPU of its own (`LOCAL_WORLD_SIZE` ranks of `torch.get_num_threads()` threads, this
    process's CPU affinity), else 0: a polling rank would take CPU time from ranks that compute."""
    raw = os.environ.get(POLL_ENV)
    if raw is not None and raw.strip():
        try:
            us = float(raw)
        except ValueError:
            raise ValueError(f"environment variable {POLL_ENV}={raw!r} must be a number of microseconds") from None
        if not 0 <= us <= 1e6:
            raise ValueError(f"environment variable {POLL_ENV}={raw!r} must be in [0, 1000000] microseconds")
        return us / 1e6
    try:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    except ValueError:
        local = 0
    wanted = local * torch.get_num_threads()  # every rank's compute threads
    return DEFAULT_POLL_US / 1e6 if 0 < wanted <= len(os.sched_getaffinity(0)) else 0.0


def _span(t: torch.Tensor) -> tuple[int, int]:
    """A contiguous CPU tensor's (address, byte size); anything else is refused as gloo refuses it.

    [Note: plain memmove] The ring copies with `ctypes.memmove` on these addresses rather than through
    torch views and `copy_`: a pipeline stage sends right after its compute, and after 10 ms asleep on
    this kind of virtual machine every page the send touches misses (a 4 KiB send through torch's views
    and `copy_` took 174 us there against 93 us by memmove; 6 and 4 us when warm). Fewer layers, fewer
    cold pages on the critical path."""
    if not t.is_contiguous():
        raise RuntimeError("input tensor has to be contiguous")
    if not t.is_cpu:
        raise RuntimeError(f"shared-memory p2p carries CPU tensors, not {t.device.type} ones")
    return t.data_ptr(), t.numel() * t.element_size()


# ---- which messages take a link ---------------------------------------------------------------------

_links: weakref.WeakKeyDictionary[ProcessGroup, dict[int, ShmLink | None]] = weakref.WeakKeyDictionary()


def shm_link(peer: int | None, group: ProcessGroup | None, tag: int, nbytes: int) -> ShmLink | None:
    """The link a p2p message of `nbytes` with global rank `peer` takes, or None (gloo): see the module's note."""
    if peer is None or tag != 0 or not _links:
        return None
    world = dist.group.WORLD
    if world is None or (group is not None and group is not world):
        return None
    link = _links.get(world, {}).get(peer)
    if link is None or nbytes > link.slot:
        return None
    return link


def shm_p2p_carries(peer: int, nbytes: int) -> bool:
    """Whether a message of `nbytes` with global rank `peer` (default group, tag 0) takes the shared-memory
    ring rather than gloo: `open_shm_p2p(peer)` linked the two and the message fits a slot.

    A receive the ring carries gains nothing from being posted early (the message waits in its slot until
    taken out), so a caller can post it when it is about to wait instead of in front of other work."""
    return shm_link(peer, None, 0, nbytes) is not None


# ---- setup ---------------------------------------------------------------------------------------------

_INFO = 6  # ok, pid, nonce, slot bytes, slot count, pid namespace


def open_shm_p2p(peer: int) -> bool:
    """Link this rank with global rank `peer` through shared memory; True where both ranks could map it.

    Both ranks must call it (once per pair, at the same point in their p2p traffic with each other):
    it exchanges two small messages over gloo. Without gloo, on another host, another container, or with
    `DS_COMM_SHM=0` on either rank, it returns False on both and their sends keep to gloo.
    """
    world = dist.group.WORLD
    if world is None:
        raise RuntimeError("open_shm_p2p: torch.distributed is not initialised")
    me = dist.get_rank()
    if peer == me or not 0 <= peer < dist.get_world_size():
        raise ValueError(f"open_shm_p2p: peer {peer} is not another rank of the {dist.get_world_size()}")
    links = _links.setdefault(world, {})
    if peer in links:
        return links[peer] is not None
    if dist.get_backend() != "gloo":
        links[peer] = None
        return False
    link = _setup(peer, low=me < peer)
    links[peer] = link
    return link is not None


def _exchange(tensor: torch.Tensor, peer: int, sending: bool) -> None:
    from ds_comm._dist_init import state

    try:
        work = (dist.isend if sending else dist.irecv)(tensor, peer, tag=_SETUP_TAG)
        assert work is not None
        work.wait(timeout=state.timeout) if state.timeout is not None else work.wait()
    except RuntimeError as err:
        raise RuntimeError(
            f"open_shm_p2p: rank {peer} did not answer while this rank {dist.get_rank()} set up their link "
            f"(both ranks must call open_shm_p2p, each naming the other): {err}"
        ) from err


def _setup(peer: int, low: bool) -> ShmLink | None:
    want = enabled()
    if low:
        created = create("p2p", _segment_bytes(SLOT_BYTES, SLOTS)) if want else None
        reply = torch.zeros(3, dtype=torch.int64)  # ok, pid namespace, pid
        try:
            if created is not None:
                words = torch.frombuffer(created[0], dtype=torch.int64, count=3)
                words[_SLOT_SIZE], words[_SLOT_COUNT] = SLOT_BYTES, SLOTS
                del words
            info = [int(created is not None), os.getpid(), created[2] if created else 0, SLOT_BYTES, SLOTS, pid_ns()]
            _exchange(torch.tensor(info, dtype=torch.int64), peer, sending=True)
            _exchange(reply, peer, sending=False)
        finally:
            if created is not None:
                unlink(created[1])  # the peer has mapped it, or never will
        ok, ns, pid = reply.tolist()
        mm, slot, slots = (created[0] if created else None), SLOT_BYTES, SLOTS
    else:
        info_t = torch.zeros(_INFO, dtype=torch.int64)
        _exchange(info_t, peer, sending=False)
        made, pid, nonce, slot, slots, ns = info_t.tolist()
        mm = attach("p2p", pid, nonce, _segment_bytes(slot, slots)) if made and want else None
        ok = int(mm is not None)
        _exchange(torch.tensor([ok, pid_ns(), os.getpid()], dtype=torch.int64), peer, sending=True)
    if not ok or mm is None:
        if mm is not None:
            close(mm)
        return None
    peer_pid = pid if ns == pid_ns() != -1 else None  # a pid means something only in the same namespace
    logger.debug("p2p with rank %d through shared memory (%d slots of %d bytes each way)", peer, slots, slot)
    return ShmLink(mm, low, slot, slots, peer, peer_pid)
