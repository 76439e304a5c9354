"""Flat all-gather and reduce-scatter between two gloo ranks as one send/receive pair each.

[Note: why a pair path] On a gloo group of two CPU ranks, torch 2.13's `reduce_scatter_single` /
`reduce_scatter_tensor` and `all_gather_single` / `all_gather_into_tensor` stage the data through
extra buffers (the reduce-scatter reduces the whole input before taking this rank's slice), so they
cost about 1.6x the CPU time of the exchange they need: each rank sends the peer the half it does not
keep and receives the peer's half of its own. Measured on 1.77M fp32 elements (one block of the 21M
GPT of benchmarks/zero.py, 2 ranks, process CPU time, loaded host): reduce-scatter 4.1 ms vs 2.5 ms,
all-gather 4.0 ms vs 2.5 ms. ZeRO-3 on two CPU ranks issues these every step for every block, forward
and backward, so the pair path is taken for them: a gloo group of exactly two ranks, CPU tensors,
contiguous, one dtype, SUM. The result is the same bits as gloo's: the all-gather copies, and the sum
of two numbers does not depend on their order. Every other case goes to torch as before.

Whether a call takes the pair path must be decided alike on both ranks, or one rank would wait in a
send while the other waits in gloo's collective (a hang until the collective timeout). So the test looks
only at what both ranks share (the group, the device, the dtype, the sizes); where this rank's buffers
overlap (an in-place call), the pair path copies instead of falling back.

The returned `PairWork` stands for the pair's two gloo works: waiting on it waits both and, for the
reduce-scatter, adds this rank's own half into the received one (the output), once. Where both ranks
share a host, the pair's data goes through a shared-memory segment instead of gloo's TCP (a `ShmWork`,
see ds_comm._shm_pair); whether a group does is agreed once by both ranks, so the rule above holds.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp, Work

from ds_comm._shm_pair import ShmWork, _Destinations, shm_channel
from ds_comm._shm_segment import completed_future

__all__ = [
    "PairWork",
    "pair_all_gather",
    "pair_all_gather_many",
    "pair_all_reduce",
    "pair_broadcast",
    "pair_exchange",
    "pair_peer",
    "pair_reduce_scatter",
]

#: A tag of their own, so that the pair's messages never match a user's `isend`/`irecv` (tag 0) on the group.
_TAG = 0x2E6C

# Per group: (this rank in the group, the peer's rank in the group), or None when it is not a 2-rank gloo group.
_peers: weakref.WeakKeyDictionary[ProcessGroup, tuple[int, int] | None] = weakref.WeakKeyDictionary()


def pair_peer(group: ProcessGroup | None) -> tuple[int, int] | None:
    """(my group rank, the peer's group rank) when `group` (None: the default group) is a 2-rank gloo group."""
    key = group if group is not None else dist.group.WORLD
    if key is None:
        return None
    if key in _peers:
        return _peers[key]
    found = None
    if dist.get_backend(key) == "gloo" and dist.get_world_size(key) == 2:
        me = dist.get_rank(key)
        found = (me, 1 - me) if me in (0, 1) else None
    _peers[key] = found
    return found


def _eligible(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.dtype == b.dtype
        and a.is_contiguous()
        and b.is_contiguous()
        and a.numel() > 0
    )


class PairWork:
    """The two gloo works of one pair exchange, and what completes it after they finish."""

    __slots__ = ("_works", "_then", "_done")

    def __init__(self, works: list[Work] | list[ShmWork], then: Callable[[], object] | None) -> None:
        self._works = works
        self._then = then
        self._done = False

    def _complete(self) -> None:
        if not self._done:
            self._done = True
            if self._then is not None:
                self._then()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        for w in self._works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout=timeout)
        self._complete()
        return True

    def is_completed(self) -> bool:
        if not self._done and all(w.is_completed() for w in self._works):
            self.wait()
        return self._done

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        self.wait()
        return completed_future()


def pair_all_gather(output: torch.Tensor, input: torch.Tensor, group: ProcessGroup | None) -> PairWork | ShmWork | None:
    """`output` = [rank 0's input, rank 1's input] by one send and one receive; None when not eligible."""
    peers = pair_peer(group)
    if peers is None or not _eligible(output, input) or output.numel() != 2 * input.numel():
        return None
    me, peer = peers
    halves = output.view(-1).chunk(2)
    mine = _own_half(halves[me], input.view(-1), output)
    return _send_recv([mine], [halves[peer]], group, peer, kind=1)


def pair_all_gather_many(
    outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: ProcessGroup | None
) -> PairWork | ShmWork | None:
    """Each `outputs[i]` = [rank 0's `inputs[i]`, rank 1's]: one send and one receive per tensor, no staging
    buffer (a coalesced gather lands in each parameter's own storage); None when not eligible (nothing sent)."""
    peers = pair_peer(group)
    if peers is None or len(outputs) != len(inputs) or not outputs:
        return None
    for o, i in zip(outputs, inputs, strict=True):
        if not _eligible(o, i) or o.numel() != 2 * i.numel():
            return None
    me, peer = peers
    sends, recvs = [], []
    for o, i in zip(outputs, inputs, strict=True):
        halves = o.view(-1).chunk(2)
        sends.append(_own_half(halves[me], i.view(-1), o))
        recvs.append(halves[peer])
    return _send_recv(sends, recvs, group, peer, kind=1)


def pair_exchange(
    sends: list[torch.Tensor],
    recvs: list[torch.Tensor],
    group: ProcessGroup | None,
    addends: list[torch.Tensor | None] | None = None,
) -> PairWork | ShmWork | None:
    """Send each of `sends` to the peer and receive each of `recvs` from it, in order (the peer's `sends[i]`
    lands in this rank's `recvs[i]`; the two lists may differ in length, even be empty, as long as the
    peer's sends match these receives); None, nothing sent, when not eligible: the decision reads each
    tensor's device, contiguity and size, which the peer's matching tensors share. With `addends`, a
    receive with an addend becomes `recvs[i] = addends[i] + peer's` (one pass through shared memory; over
    gloo, added once received): the second half of a two-rank reduction, in IEEE's either-order sum."""
    peers = pair_peer(group)
    if peers is None or not (sends or recvs):
        return None
    for t in (*sends, *recvs):
        if t.device.type != "cpu" or not t.is_contiguous() or t.numel() == 0:
            return None
    if addends is not None and len(addends) != len(recvs):
        raise ValueError(f"pair_exchange: {len(addends)} addends for {len(recvs)} receives")
    peer = peers[1]
    channel = shm_channel(group)
    if channel is not None:
        return channel.exchange(list(sends), list(recvs), addends=addends)
    works: list[Work | None] = []
    dests = _Destinations(recvs)
    for b in sends:
        b = dests.unshared(b, -1)  # a copy where a receive could overwrite what is still being sent
        works.append(dist.isend(b, group=group, group_dst=peer, tag=_TAG))
    for a in recvs:
        works.append(dist.irecv(a, group=group, group_src=peer, tag=_TAG))
    then = None
    if addends is not None and any(a is not None for a in addends):

        def then() -> None:
            with torch.no_grad():
                for r, a in zip(recvs, addends, strict=True):
                    if a is not None:
                        torch.add(a.view(-1), r.view(-1), out=r.view(-1))

    return PairWork([w for w in works if w is not None], then)


def pair_reduce_scatter(
    output: torch.Tensor, input: torch.Tensor, op: ReduceOp.RedOpType, group: ProcessGroup | None
) -> PairWork | ShmWork | None:
    """`output` = both ranks' slice `rank` of `input` summed, by one send and one receive; None if not eligible."""
    peers = pair_peer(group)
    if peers is None or op != ReduceOp.SUM or not _eligible(output, input) or input.numel() != 2 * output.numel():
        return None
    me, peer = peers
    halves = input.view(-1).chunk(2)
    out = output.view(-1)
    own = halves[me]
    channel = shm_channel(group)
    if channel is not None:  # out = own + peer's, taken straight out of the segment
        return channel.exchange([halves[peer]], [out], [own], kind=2)
    # An output inside the input (an in-place reduce-scatter into this rank's own slice): the peer's half
    # lands in a buffer of its own, or the receive would overwrite what is still to be added or sent.
    landing = torch.empty_like(out) if _overlaps(out, input) else out
    works = [
        dist.isend(halves[peer], group=group, group_dst=peer, tag=_TAG),
        dist.irecv(landing, group=group, group_src=peer, tag=_TAG),
    ]

    def add_own() -> None:
        if landing is out:
            out.add_(own)
        else:
            out.copy_(own + landing)

    return PairWork([w for w in works if w is not None], add_own)


def pair_all_reduce(
    tensor: torch.Tensor, op: ReduceOp.RedOpType, group: ProcessGroup | None
) -> PairWork | ShmWork | None:
    """`tensor` = both ranks' `tensor` summed, through the group's shared segment: one copy in, one addition
    out. None (the caller goes to gloo) unless the group has a segment (see ds_comm._shm_pair): over gloo
    itself, torch's all-reduce of two ranks costs no more than a send/receive pair would. The decision reads
    the group, the op, the device and the dtype (alike on both ranks); a non-contiguous tensor goes
    through a contiguous copy rather than to gloo, which its peer might not."""
    if (
        pair_peer(group) is None
        or op != ReduceOp.SUM
        or tensor.device.type != "cpu"
        or tensor.numel() == 0
        or tensor.dtype not in _SUMMABLE
    ):
        return None
    channel = shm_channel(group)
    if channel is None:
        return None
    if tensor.is_contiguous():
        return channel.exchange([tensor], [tensor], [tensor], kind=3)
    flat = tensor.contiguous()
    work = channel.exchange([flat], [flat], [flat], kind=3)
    return PairWork([work], lambda: tensor.copy_(flat))


def pair_broadcast(tensor: torch.Tensor, src: int, group: ProcessGroup | None) -> PairWork | ShmWork | None:
    """`tensor` = global rank `src`'s `tensor`, through the group's shared segment (one copy in, one out).
    None (the caller goes to gloo) unless the group has a segment; decided from the group, the device
    and the size, alike on both ranks (a non-contiguous tensor goes through a contiguous copy)."""
    peers = pair_peer(group)
    if peers is None or tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    key = group if group is not None else dist.group.WORLD
    try:
        root = src if key is None or key is dist.group.WORLD else dist.get_group_rank(key, src)
    except (RuntimeError, ValueError):
        return None  # not a member: torch raises its own error
    channel = shm_channel(group)
    if channel is None:
        return None
    flat = tensor if tensor.is_contiguous() else tensor.contiguous()
    if root == peers[0]:
        return channel.exchange([flat], [], kind=4)
    work = channel.exchange([], [flat], kind=4)
    return work if flat is tensor else PairWork([work], lambda: tensor.copy_(flat))


_SUMMABLE = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int32, torch.int64}
)


def _send_recv(
    sends: list[torch.Tensor], recvs: list[torch.Tensor], group: ProcessGroup | None, peer: int, kind: int
) -> PairWork | ShmWork:
    """The peer's `sends[i]` into this rank's `recvs[i]`: through the group's shared segment when it has
    one, else one gloo send and receive per tensor."""
    channel = shm_channel(group)
    if channel is not None:
        return channel.exchange(sends, recvs, kind=kind)
    works: list[Work | None] = []
    for a, b in zip(sends, recvs, strict=True):
        works.append(dist.isend(a, group=group, group_dst=peer, tag=_TAG))
        works.append(dist.irecv(b, group=group, group_src=peer, tag=_TAG))
    return PairWork([w for w in works if w is not None], None)


def _own_half(slot: torch.Tensor, mine: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """Put this rank's input in its slot of the output; returns what to send. An input that is already
    the slot (an in-place gather) is sent as it is; one overlapping the output elsewhere is copied first,
    as the receive would overwrite it while it is sent."""
    if slot.data_ptr() == mine.data_ptr():
        return mine
    if _overlaps(mine, output):
        mine = mine.clone()
    slot.copy_(mine)
    return mine


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
