"""The shared-memory pair exchange copies a source only when another destination overlaps it.

`_Destinations.unshared` answers with a binary search over the destinations' sorted byte ranges; here it is
checked against the pairwise definition (any destination but the source's own identical one sharing a byte)
on random layouts of views into one buffer: overlapping destinations, in-place sources, empty tensors,
other dtypes, and index -1 (the gloo path's sends, which have no destination of their own).
"""

from __future__ import annotations

import random

import torch

from ds_comm._shm_pair import _Destinations


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def _must_copy(t: torch.Tensor, recvs: list[torch.Tensor], index: int) -> bool:
    for j, r in enumerate(recvs):
        same = j == index and r.data_ptr() == t.data_ptr() and r.numel() == t.numel() and r.dtype == t.dtype
        if not same and r.numel() and _overlap(r, t):
            return True
    return False


def _view(buffer: torch.Tensor, rng: random.Random) -> torch.Tensor:
    start = rng.randrange(0, 200)
    length = rng.choice([0, 1, 3, 8, 17, 40])
    view = buffer[start : start + length]
    even = view.numel() % 2 == 0 and start % 2 == 0
    return view.view(torch.int16) if rng.random() < 0.2 and even else view


def test_copies_exactly_where_another_destination_overlaps() -> None:
    rng = random.Random(0)
    buffer = torch.zeros(256, dtype=torch.uint8)
    separate = [torch.zeros(16) for _ in range(4)]
    copies = kept = 0
    for _ in range(3000):
        recvs = [_view(buffer, rng) if rng.random() < 0.7 else rng.choice(separate) for _ in range(rng.randrange(1, 8))]
        dests = _Destinations(recvs)
        for index in [*range(len(recvs)), -1]:  # -1: a source with no destination of its own (gloo's sends)
            t = recvs[index] if rng.random() < 0.3 else _view(buffer, rng)  # in place, or any source
            out = dests.unshared(t, index)
            if _must_copy(t, recvs, index):
                assert out is not t and torch.equal(out, t)
                copies += 1
            else:
                assert out is t
                kept += 1
    assert copies > 1000 and kept > 1000  # both answers were exercised
