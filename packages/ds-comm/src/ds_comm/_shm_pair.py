"""The two ranks of a gloo group on one host exchange collective data through shared memory, not TCP.

[Note: why shared memory] ZeRO-3 on two CPU ranks moves ~250 MB per rank per step through gloo
(forward gather, backward re-gather, gradient reduce-scatter). Over TCP loopback each byte is copied
into the kernel and out again, in packets, with a socket wake-up per packet and gloo's worker threads
around it: a large share of the step's CPU time that is neither compute nor a plain copy. Here each
rank copies what it sends into a segment both ranks have mapped, and the peer copies (or adds) it
straight from there into its destination: two memory copies and a few atomic words per message.

[Note: the segment] One per 2-rank gloo group, made on the group's first pair exchange: a header page
(a nonce, the slot size, four 32-bit counters, each on a cache line of its own), then two slots per
rank of `slot` bytes each, every slot with a 64-byte header (the message's size and the chunk's index,
checked by the reader). Group rank 0 creates the file and rank 1 maps it as ds_comm._shm_segment
describes; both say whether that worked in one all-gather before rank 0 unlinks it.

[Note: the same decision on both ranks] A rank that exchanges through shared memory while its peer sends
over gloo waits forever. So whether a group uses the segment is decided once, from facts both ranks hold
after the setup's all-gathers (rank 0 made and filled the segment, rank 1 mapped it and read the nonce,
neither has it turned off); `DS_COMM_SHM=0` on any rank turns it off for the group. The slot size is
rank 0's (`DS_COMM_SHM_SLOT_MB`). Only on x86-64 Linux (ds_comm._shm_segment's [Note: counters]).

[Note: protocol] Every exchange (a list of tensors to send, and as many destinations of the same byte
sizes to receive the peer's into) is one message, laid out at 64-byte aligned offsets and cut into chunks
of at most `slot` bytes. Chunk s (1, 2, ... over the group's life, alike on both ranks, as both issue the
same exchanges in the same order with the same sizes) goes into its writer's slot s % 2. Counters:
`written[r]`, the last chunk rank r has put in its slots, and `read[r]`, the last chunk of its peer that
rank r has taken out. Issuing chunk s: (1) take out every peer chunk up to s - 2 still pending (waiting for
it to be written); (2) wait until the peer has taken out this rank's chunk s - 2, so its slot is free;
(3) copy into the slot, publish `written[me] = s`, wake the peer. Waiting on a work takes out the peer's
chunks up to the work's last. Nothing waits for anything a peer has not yet been able to do: a rank in
(1) or (2) waits on a peer that has not passed its own issue of chunk s (once past it, it has written
chunk s - 2 and taken out chunk s - 2, both by its own step (1)), so the peer is at an earlier point of
the same sequence, where it waits only on what this rank already did. A message of one chunk is
therefore asynchronous (issued and left, as gloo's); a larger one proceeds in step with the peer.

Waits sleep on a futex over the counter's word, so a waiting rank burns no CPU; they give up with
`TimeoutError` at the collective's timeout, and earlier with a `RuntimeError` when the peer process is
gone (checked by pid when both ranks share a pid namespace).

Results are gloo's bits: an exchange copies; a reduction of two ranks is one addition `own + peer`,
which IEEE makes the same in either order (and torch's bf16/fp16 addition, like gloo's, adds in fp32
and rounds once).
"""

from __future__ import annotations

import bisect
import ctypes
import functools
import itertools
import logging
import mmap
import os
import threading
import time
import weakref
from collections import deque
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ds_comm._shm_segment import (
    ENV,
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
    pair_rows,
    pid_ns,
    reached,
    timeout_seconds,
    unlink,
)

__all__ = ["ENV", "SLOT_ENV", "ShmChannel", "ShmWork", "shm_channel"]

logger = logging.getLogger(__name__)

SLOT_ENV = "DS_COMM_SHM_SLOT_MB"
"""Size of one slot in MiB (group rank 0's value counts); a segment holds four, plus a header page."""
DEFAULT_SLOT_MB = 8

KINDS = {0: "an exchange", 1: "all_gather", 2: "reduce_scatter", 3: "all_reduce", 4: "broadcast"}
"""What `ShmChannel.exchange(kind=)` codes stand for, in messages."""

_HEADER = 4096
_SLOT_HEADER = 64
_ALIGN = 64
_NONCE, _SLOT = 0, 8  # header words (int64)
_WRITTEN, _READ = 64, 192  # + 64 * rank: one cache line per 32-bit counter


def _slot_bytes() -> int:
    raw = os.environ.get(SLOT_ENV, str(DEFAULT_SLOT_MB))
    try:
        mb = float(raw)
    except ValueError:
        raise ValueError(f"environment variable {SLOT_ENV}={raw!r} must be a number of MiB") from None
    if not 0 < mb <= 4096:
        raise ValueError(f"environment variable {SLOT_ENV}={raw!r} must be in (0, 4096] MiB")
    return max(4096, int(mb * 2**20) // 4096 * 4096)


def _segment_bytes(slot: int) -> int:
    return _HEADER + 4 * (_SLOT_HEADER + slot)


def _words(buf: torch.Tensor) -> torch.Tensor:
    return buf[:_HEADER].view(torch.int64)


class _Layout:
    """Where each tensor of a message sits in the message's bytes, and which parts fall in which chunk:
    per chunk, (tensor index, first byte in the tensor, byte count, offset in the slot, whole tensor?).
    A chunk past the message's end is empty (a message shorter than the peer's)."""

    __slots__ = ("total", "chunks", "pieces")

    def __init__(self, sizes: tuple[int, ...], slot: int) -> None:
        offsets = []
        pos = 0
        for n in sizes:
            pos = -(-pos // _ALIGN) * _ALIGN
            offsets.append(pos)
            pos += n
        self.total = pos
        self.chunks = max(1, -(-pos // slot))
        self.pieces: list[list[tuple[int, int, int, int, bool]]] = []
        for c in range(self.chunks):
            lo, hi = c * slot, (c + 1) * slot
            chunk = []
            for i, (off, n) in enumerate(zip(offsets, sizes, strict=True)):
                a, b = max(lo, off), min(hi, off + n)
                if a < b:
                    chunk.append((i, a - off, b - a, a - lo, b - a == n))
            self.pieces.append(chunk)


@functools.lru_cache(maxsize=4096)
def _layout(sizes: tuple[int, ...], slot: int) -> _Layout:
    """Layouts repeat step after step (the same parameters, the same buckets): made once each."""
    return _Layout(sizes, slot)


def _sizes(tensors: list[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.numel() * t.element_size() for t in tensors)


class ShmWork:
    """One exchange through the segment; `wait()` takes the peer's data out into the destinations."""

    __slots__ = ("_channel", "_last", "_done")

    def __init__(self, channel: ShmChannel, last: int) -> None:
        self._channel = channel
        self._last = last
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if not self._done:
            self._channel.complete(self._last, timeout)
            self._done = True
        return True

    def is_completed(self) -> bool:
        if not self._done and self._channel.try_complete(self._last):
            self._done = True
        return self._done

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        self.wait()
        return completed_future()


class ShmChannel:
    """This rank's side of a group's segment: issues exchanges, takes the peer's chunks out in order."""

    def __init__(self, mm: mmap.mmap, me: int, slot: int, peer_pid: int | None) -> None:
        self._mm = mm
        self._buf = torch.frombuffer(mm, dtype=torch.uint8)
        base = self._buf.data_ptr()
        self._me, self._peer = me, 1 - me
        self.slot = slot
        self._peer_pid = peer_pid
        self._written = [ctypes.c_uint32.from_address(base + _WRITTEN + 64 * r) for r in (0, 1)]
        self._read = [ctypes.c_uint32.from_address(base + _READ + 64 * r) for r in (0, 1)]
        self._written_addr = [base + _WRITTEN + 64 * r for r in (0, 1)]
        self._read_addr = [base + _READ + 64 * r for r in (0, 1)]
        self._slots = [
            [self._buf[self._slot_at(r, k) + _SLOT_HEADER : self._slot_at(r, k) + _SLOT_HEADER + slot] for k in (0, 1)]
            for r in (0, 1)
        ]
        # each slot's header: (the message's byte size, the chunk's index, the collective), for the reader to check
        self._heads = [[(ctypes.c_int64 * 3).from_address(base + self._slot_at(r, k)) for k in (0, 1)] for r in (0, 1)]
        self._next = 1  # the next chunk this rank writes
        self._pending: deque[tuple[int, int, _Layout, list[torch.Tensor], list[torch.Tensor | None], int]] = deque()
        self._taken = 0  # the last peer chunk taken out
        self._lock = threading.Lock()
        self._broken: str | None = None

    def _slot_at(self, rank: int, k: int) -> int:
        return _HEADER + (2 * rank + k) * (_SLOT_HEADER + self.slot)

    # ---- issuing -------------------------------------------------------------------------------------

    def exchange(
        self,
        sends: list[torch.Tensor],
        recvs: list[torch.Tensor],
        addends: list[torch.Tensor | None] | None = None,
        timeout: timedelta | None = None,
        kind: int = 0,
    ) -> ShmWork:
        """Send `sends` to the peer and receive what it sends into `recvs`: its i-th tensor lands in
        `recvs[i]`, or `recvs[i] = addends[i] + peer's` where an addend is given. Contiguous CPU tensors;
        the peer's i-th send has `recvs[i]`'s byte size (and an addend `recvs[i]`'s shape and dtype).
        Either list may be empty (a broadcast sends only, or receives only); both ranks' calls must match
        (this rank's sends are the peer's recvs). The sends are read before this returns; the destinations
        are complete once the returned work's `wait()` returns. `kind` names the collective (both ranks
        must give the same; the reader checks it with the sizes, so mismatched collectives fail loudly)."""
        adds: list[torch.Tensor | None] = list(addends) if addends is not None else [None] * len(recvs)
        out_layout, in_layout = _layout(_sizes(sends), self.slot), _layout(_sizes(recvs), self.slot)
        chunks = max(out_layout.chunks, in_layout.chunks)  # the same number on both ranks
        with self._lock:
            self._check()
            deadline = time.monotonic() + timeout_seconds(timeout)
            if chunks > 1 or any(a is not None for a in adds):
                dests = _Destinations(recvs)
                if chunks > 1:  # later chunks are sent after earlier ones were received: no overwrites
                    sends = [dests.unshared(s, i) for i, s in enumerate(sends)]
                adds = [a if a is None else dests.unshared(a, i) for i, a in enumerate(adds)]
            views = [_bytes(t) for t in sends]
            first = self._next
            try:
                for c in range(chunks):
                    s = first + c
                    self._take_out(s - 2, deadline)
                    self._wait(self._read, self._read_addr, self._peer, s - 2, deadline, "take out")
                    slot = self._slots[self._me][s % 2]
                    head = self._heads[self._me][s % 2]
                    head[0], head[1], head[2] = out_layout.total, c, kind
                    for i, a, n, at, whole in out_layout.pieces[c] if c < out_layout.chunks else ():
                        slot[at : at + n].copy_(views[i] if whole else views[i][a : a + n])
                    self._written[self._me].value = s & MASK
                    futex(self._written_addr[self._me], FUTEX_WAKE, WAKE_ALL)
                    self._pending.append((s, c, in_layout, recvs, adds, kind))
                self._next = first + chunks
            except BaseException as err:
                self._broken = f"an earlier exchange failed: {err}"
                raise
        return ShmWork(self, first + chunks - 1)

    # ---- receiving -----------------------------------------------------------------------------------

    def complete(self, last: int, timeout: timedelta | None) -> None:
        """Take out the peer's chunks up to `last` (and every earlier one), waiting for them as needed."""
        with self._lock:
            self._check()
            try:
                self._take_out(last, time.monotonic() + timeout_seconds(timeout))
            except BaseException as err:
                self._broken = f"an earlier exchange failed: {err}"
                raise

    def try_complete(self, last: int) -> bool:
        """`complete(last)` if the peer has written everything up to it already; else False, nothing waited."""
        with self._lock:
            if self._taken >= last:
                return True
            if not reached(self._written[self._peer].value, last & MASK):
                return False
        self.complete(last, None)
        return True

    def _take_out(self, upto: int, deadline: float) -> None:
        while self._pending and self._pending[0][0] <= upto:
            s, c, layout, recvs, adds, kind = self._pending[0]
            self._wait(self._written, self._written_addr, self._peer, s, deadline, "write")
            slot = self._slots[self._peer][s % 2]
            head = self._heads[self._peer][s % 2]
            total, index, theirs = head[0], head[1], head[2]
            if total != layout.total or index != c or theirs != kind:
                raise RuntimeError(
                    f"shared-memory pair exchange: the peer sent {total} bytes (chunk {index}) of "
                    f"{KINDS.get(theirs, theirs)} where this rank expects {layout.total} (chunk {c}) of "
                    f"{KINDS.get(kind, kind)}; the two ranks issued different collectives"
                )
            for i, a, n, at, whole in layout.pieces[c] if c < layout.chunks else ():
                src = slot[at : at + n]
                dest, add = recvs[i], adds[i]
                if add is None:
                    if whole:
                        _bytes(dest).copy_(src)
                    else:
                        _bytes(dest)[a : a + n].copy_(src)
                elif whole:
                    torch.add(add.view(-1), src.view(dest.dtype), out=dest.view(-1))
                else:
                    size = dest.element_size()
                    lo, hi = a // size, (a + n) // size
                    torch.add(add.view(-1)[lo:hi], src.view(dest.dtype), out=dest.view(-1)[lo:hi])
            self._pending.popleft()
            self._taken = s
            self._read[self._me].value = s & MASK
            futex(self._read_addr[self._me], FUTEX_WAKE, WAKE_ALL)

    def _wait(
        self, words: list[ctypes.c_uint32], addrs: list[int], rank: int, target: int, deadline: float, what: str
    ) -> None:
        """Until counter `words[rank]` reaches `target`: sleep on its futex, up to the deadline."""
        word, goal = words[rank], target & MASK
        while True:
            value = word.value
            if reached(value, goal):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"shared-memory pair exchange: timed out waiting for the peer to {what} chunk {target}"
                )
            self._check_peer()
            futex(addrs[rank], FUTEX_WAIT, value, min(left, POLL_S))

    def _check_peer(self) -> None:
        check_peer(self._peer_pid, "shared-memory pair exchange")

    def _check(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"shared-memory pair exchange unusable: {self._broken}")


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, flat."""
    return t.view(-1).view(torch.uint8)


class _Destinations:
    """The receive tensors' byte ranges, sorted, so that whether a source overlaps one is a binary search
    (an exchange of n tensors each way checked n * n pairs: 46k checks, ~60 ms, per step of a 21M model at
    ZeRO-3, whose after-step all-gather sends and receives every parameter)."""

    def __init__(self, recvs: list[torch.Tensor]) -> None:
        self.recvs = recvs
        self.spans = sorted(
            (r.data_ptr(), r.data_ptr() + r.numel() * r.element_size(), j) for j, r in enumerate(recvs) if r.numel()
        )
        self.starts = [start for start, _, _ in self.spans]
        self.reach = list(itertools.accumulate((end for _, end, _ in self.spans), max))  # furthest end so far

    def unshared(self, t: torch.Tensor, index: int) -> torch.Tensor:
        """`t`, or a copy of it where a destination other than its own overlaps it (and could overwrite it
        before it is read); being its own destination (an in-place reduction) is safe, chunk by chunk.
        `index` -1: `t` has no destination of its own, so any overlap counts."""
        t0 = t.data_ptr()
        t1 = t0 + t.numel() * t.element_size()
        k = bisect.bisect_left(self.starts, t1) - 1  # the last destination starting before t ends
        while k >= 0 and self.reach[k] > t0:  # some destination at or before k still reaches into t
            start, end, j = self.spans[k]
            if end > t0:
                r = self.recvs[j]
                same = j == index and start == t0 and r.numel() == t.numel() and r.dtype == t.dtype
                if not same:
                    return t.clone()
            k -= 1
        return t


# ---- setup ---------------------------------------------------------------------------------------------

_channels: weakref.WeakKeyDictionary[ProcessGroup, ShmChannel | None] = weakref.WeakKeyDictionary()


def shm_channel(group: ProcessGroup | None) -> ShmChannel | None:
    """The group's channel, or None when it keeps to gloo (any group but one of two gloo ranks). The first
    call on a 2-rank group sets the segment up with two all-gathers over it, so both ranks must make it at
    the same point (see the module's note)."""
    key = group if group is not None else dist.group.WORLD
    if key is None:
        return None
    if key in _channels:
        return _channels[key]
    if dist.get_backend(key) != "gloo" or dist.get_world_size(key) != 2:
        _channels[key] = None
        return None
    channel = _setup(group)
    _channels[key] = channel
    return channel


def _create(slot: int) -> tuple[mmap.mmap, str, int] | None:
    created = create("pair", _segment_bytes(slot))
    if created is not None:
        _words(torch.frombuffer(created[0], dtype=torch.uint8))[_SLOT // 8] = slot
    return created


def _attach(pid: int, nonce: int, slot: int) -> mmap.mmap | None:
    mm = attach("pair", pid, nonce, _segment_bytes(slot))
    if mm is None:
        return None
    if int(_words(torch.frombuffer(mm, dtype=torch.uint8))[_SLOT // 8]) != slot:
        close(mm)
        return None
    return mm


def _setup(group: ProcessGroup | None) -> ShmChannel | None:
    me = dist.get_rank(group)
    want = enabled()
    slot = _slot_bytes() if want and me == 0 else 0
    created = _create(slot) if want and me == 0 else None
    mm: mmap.mmap | None = None
    try:
        # ok, pid, nonce, slot bytes, pid namespace, user id
        wanted = int(created is not None or (want and me == 1))
        info = [wanted, os.getpid(), created[2] if created else 0, slot, pid_ns(), os.getuid()]
        r0, r1 = pair_rows(info, group)
        if me == 0 and created is not None:
            mm = created[0]
        elif me == 1 and r0[0] and r1[0]:
            mm = _attach(r0[1], r0[2], r0[3])
        both = pair_rows([int(mm is not None)], group)
    finally:
        if created is not None:
            unlink(created[1])  # both ranks have mapped it (or never will): the name can go
    if not (both[0][0] and both[1][0]) or mm is None:
        if mm is not None:
            close(mm)
        return None
    peer = r1 if me == 0 else r0
    same_ns = r0[4] == r1[4] and r0[4] != -1
    return ShmChannel(mm, me, r0[3], peer[1] if same_ns else None)
