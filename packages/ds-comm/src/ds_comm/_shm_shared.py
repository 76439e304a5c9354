"""Two ranks of one host each own a tensor in shared memory that the other reads in place.

[Note: why read the peer's memory] ZeRO-1/2 on two ranks moves every parameter and gradient once per step:
each rank averages its half of both ranks' gradients and, after the step, takes the half its peer updated.
Through the pair channel (ds_comm._shm_pair) each such byte is copied twice: into the channel's slot by the
sender and out of it by the receiver. When the gradients and parameters themselves live in memory both
ranks have mapped, the receiver reads them where they are: one pass instead of two, no slot, no receive
buffer. (On the 21M GPT's 42 MB halves a copy costs ~3.6 ms per rank, and a reduction reads both halves
anyway.)

[Note: the contract] `pair_shared_tensor` (a collective of a two-rank gloo group) gives each rank `mine`,
a tensor in a segment it created, and `peer`, its mapping of the other rank's `mine`. A rank writes only
its own `mine`; the peer's is read only between two `barrier()` calls that both ranks make: the first
says "what I wrote is final", the second "I am done reading yours", so after it each may write its own
again. Nothing else orders the two processes, so a caller that reads `peer` outside that window reads
whatever is there.

[Note: the barrier] Each segment's header holds its owner's counters (32-bit words, each on a cache line of
its own, written only by the owner, published after the data as ds_comm._shm_segment's [Note: counters]
says). `barrier()` raises this rank's first counter and sleeps on the peer's until it reaches the same:
the peer is at most one barrier ahead or behind. The others are the caller's (`post`, `wait_for`), for
finer orders than "both are here" (ZeRO-2 counts the buckets each rank wrote and read). A wait gives up at
the collective timeout (`TimeoutError`, naming what was waited for), and early with a `RuntimeError` when
the peer process is gone.

Each rank creates its own segment (so its memory is its own, counted in its own RSS until the peer
reads it), both map both, and both names are unlinked once mapped: nothing stays in /dev/shm. Where
either rank cannot (the switch `DS_COMM_SHM=0`, another host, a full /dev/shm), both get None from the
same all-gathered facts, and the caller keeps its collectives.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import time
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
    create,
    enabled,
    futex,
    pair_rows,
    pid_ns,
    reached,
    timeout_seconds,
    unlink,
)

__all__ = ["PairSharedTensor", "pair_shared_tensor"]

_HEADER = 4096
_COUNT = 64  # byte offset of the owner's first counter (the barrier's); each on a cache line of its own
WORDS = 8
"""Counters per rank: the barrier's and seven a caller may `post` and `wait_for`."""
_KIND = "shared"


class PairSharedTensor:
    """This rank's `mine` (its own, in shared memory) and `peer` (the other rank's `mine`), with the barrier
    that orders them: see ds_comm._shm_shared's notes. Made by `pair_shared_tensor`."""

    def __init__(self, mine: mmap.mmap, peer: mmap.mmap, numel: int, dtype: torch.dtype, peer_pid: int | None) -> None:
        # storages of exactly the data (memory accounting reads a tensor's storage size), after the header
        self.mine = _data(mine, numel, dtype)
        self.peer = _data(peer, numel, dtype)
        mine_base = torch.frombuffer(mine, dtype=torch.uint8, count=_HEADER).data_ptr()
        peer_base = torch.frombuffer(peer, dtype=torch.uint8, count=_HEADER).data_ptr()
        self._mine_addrs = [mine_base + _COUNT + 64 * w for w in range(WORDS)]
        self._peer_addrs = [peer_base + _COUNT + 64 * w for w in range(WORDS)]
        self._mine_words = [ctypes.c_uint32.from_address(a) for a in self._mine_addrs]
        self._peer_words = [ctypes.c_uint32.from_address(a) for a in self._peer_addrs]
        self._mappings = (mine, peer)  # alive as long as this object (the tensors keep them too)
        self._peer_pid = peer_pid
        self._count = 0

    def barrier(self, timeout: timedelta | None = None) -> None:
        """Wait until the peer has made as many `barrier()` calls as this rank (this one included)."""
        self._count += 1
        self.post(0, self._count)
        self.wait_for(0, self._count, f"reach barrier {self._count} (both ranks must call barrier() alike)", timeout)

    def post(self, word: int, value: int) -> None:
        """Publish `value` in this rank's counter `word` (1 to WORDS - 1; 0 is the barrier's), after every
        write before it (the module's [Note: the barrier]), and wake a peer waiting on it."""
        self._mine_words[word].value = value & MASK
        futex(self._mine_addrs[word], FUTEX_WAKE, WAKE_ALL)

    def peer_reached(self, word: int, value: int) -> bool:
        """Whether the peer's counter `word` has reached `value` (what `wait_for` waits for; never waits)."""
        return reached(self._peer_words[word].value, value & MASK)

    def wait_for(self, word: int, value: int, what: str, timeout: timedelta | None = None) -> None:
        """Sleep until the peer's counter `word` reaches `value` (counters only grow, modulo 2**32); `what` the
        peer is waited for to do, for the timeout's message."""
        target = value & MASK
        deadline = time.monotonic() + timeout_seconds(timeout)
        while True:
            current = self._peer_words[word].value
            if reached(current, target):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"shared tensor of two ranks: timed out waiting for the peer to {what}")
            check_peer(self._peer_pid, "shared tensor of two ranks")
            futex(self._peer_addrs[word], FUTEX_WAIT, current, min(left, POLL_S))


def _data(mm: mmap.mmap, numel: int, dtype: torch.dtype) -> torch.Tensor:
    if numel == 0:
        return torch.empty(0, dtype=dtype)
    return torch.frombuffer(mm, dtype=dtype, count=numel, offset=_HEADER)


def pair_shared_tensor(numel: int, dtype: torch.dtype, group: ProcessGroup | None = None) -> PairSharedTensor | None:
    """A `PairSharedTensor` of `numel` elements (zero-filled) for the two ranks of a gloo `group` on one host,
    or None (another backend or size, another host, shared memory off or full: see the module's notes).

    A collective: both ranks call it at the same point with the same `numel` and `dtype`.
    """
    if not dist.is_initialized():
        return None
    key = group if group is not None else dist.group.WORLD
    if dist.get_backend(key) != "gloo" or dist.get_world_size(key) != 2:
        return None
    nbytes = int(numel) * torch.empty(0, dtype=dtype).element_size()
    size = _HEADER + max(nbytes, 1)
    me = dist.get_rank(key)
    created = create(_KIND, size) if enabled() else None
    peer_mm: mmap.mmap | None = None
    try:
        # want, pid, nonce, bytes, pid namespace, user id
        info = [int(created is not None), os.getpid(), created[2] if created else 0, nbytes, pid_ns(), os.getuid()]
        rows = pair_rows(info, group)
        mine_row, peer_row = rows[me], rows[1 - me]
        if mine_row[3] != peer_row[3]:
            raise ValueError(
                f"pair_shared_tensor: this rank asked for {mine_row[3]} bytes and its peer for {peer_row[3]}; "
                "both ranks must ask for the same numel and dtype"
            )
        if created is not None and peer_row[0]:
            peer_mm = attach(_KIND, peer_row[1], peer_row[2], size)
        both = pair_rows([int(peer_mm is not None)], group)
    finally:
        if created is not None:
            unlink(created[1])  # the peer has mapped it (or never will): the name can go
    if created is None or peer_mm is None or not (both[0][0] and both[1][0]):
        for mm in (created[0] if created else None, peer_mm):
            if mm is not None:
                close(mm)
        return None
    same_ns = mine_row[4] == peer_row[4] and mine_row[4] != -1
    return PairSharedTensor(created[0], peer_mm, int(numel), dtype, peer_row[1] if same_ns else None)
