"""The shared-memory channel's protocol in one process: both sides of a segment, one per thread.

The dist tests (tests/dist/test_dist_shm_pair.py) check the results against gloo; these check what
one process can: chunking with a peer that lags far behind, a peer process that is gone, the switch.
"""

from __future__ import annotations

import mmap
import subprocess
import threading
from datetime import timedelta

import pytest
import torch

from ds_comm import _shm_pair
from ds_comm._shm_pair import ShmChannel, _segment_bytes

SLOT = 4096


def _pair(peer_pid: int | None = None) -> tuple[ShmChannel, ShmChannel]:
    mm = mmap.mmap(-1, _segment_bytes(SLOT))  # anonymous and shared: both channels see the same bytes
    return ShmChannel(mm, 0, SLOT, peer_pid), ShmChannel(mm, 1, SLOT, peer_pid)


def _side(channel: ShmChannel, rank: int, out: dict[int, list[torch.Tensor]], lag: threading.Event | None) -> None:
    if lag is not None:
        lag.wait(5)
    got = []
    works = []
    for n, dtype in ((1, torch.float32), (3001, torch.float16), (10_000, torch.float32), (5, torch.bfloat16)):
        send = torch.arange(n, dtype=torch.float32).to(dtype) + rank
        recv = torch.empty_like(send)
        works.append(channel.exchange([send], [recv], timeout=timedelta(seconds=20)))
        got.append(recv)
        summed = torch.full((n,), 1.5 * (rank + 1), dtype=dtype)
        works.append(channel.exchange([summed], [summed], [summed], timeout=timedelta(seconds=20)))
        got.append(summed)
    for w in reversed(works):
        w.wait(timedelta(seconds=20))
    out[rank] = got


def test_chunked_exchanges_with_a_lagging_peer() -> None:
    a, b = _pair()
    out: dict[int, list[torch.Tensor]] = {}
    lag = threading.Event()
    t = threading.Thread(target=_side, args=(b, 1, out, lag))
    t.start()
    threading.Timer(0.3, lag.set).start()  # rank 0 runs ahead into a full slot and waits
    _side(a, 0, out, None)
    t.join(30)
    assert set(out) == {0, 1}
    for rank in (0, 1):
        received, summed = out[rank][0::2], out[rank][1::2]
        for r, s, (n, dtype) in zip(
            received,
            summed,
            ((1, torch.float32), (3001, torch.float16), (10_000, torch.float32), (5, torch.bfloat16)),
            strict=True,
        ):
            assert torch.equal(r, torch.arange(n, dtype=torch.float32).to(dtype) + (1 - rank))
            assert torch.equal(s, torch.full((n,), 1.5, dtype=dtype) + torch.full((n,), 3.0, dtype=dtype))


def test_a_dead_peer_is_an_error_not_a_wait() -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    a, _ = _pair(peer_pid=gone.pid)
    work = a.exchange([torch.ones(3)], [torch.empty(3)], timeout=timedelta(seconds=30))
    with pytest.raises(RuntimeError, match=f"pid {gone.pid}\\) has exited"):
        work.wait(timedelta(seconds=30))
    with pytest.raises(RuntimeError, match="unusable"):  # the channel stays refused after a failure
        a.exchange([torch.ones(3)], [torch.empty(3)])


def test_timeout_names_the_chunk() -> None:
    a, _ = _pair()
    work = a.exchange([torch.ones(3)], [torch.empty(3)])
    with pytest.raises(TimeoutError, match="chunk 1"):
        work.wait(timedelta(seconds=0.2))


@pytest.mark.parametrize(("value", "on"), [("0", False), ("off", False), ("false", False), ("1", True), ("", True)])
def test_switch(monkeypatch: pytest.MonkeyPatch, value: str, on: bool) -> None:
    monkeypatch.setenv(_shm_pair.ENV, value)
    assert _shm_pair.enabled() is on


def test_bad_slot_size_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_shm_pair.SLOT_ENV, "lots")
    with pytest.raises(ValueError, match="DS_COMM_SHM_SLOT_MB='lots'"):
        _shm_pair._slot_bytes()
