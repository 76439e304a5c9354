"""The per-group backend cache: an entry dies with its group, so a new group at a reused address is asked afresh."""

from __future__ import annotations

import gc

import pytest
import torch.distributed as dist

from ds_comm import _group_cache


class _FakeGroup:
    """Stands in for a ProcessGroup: weakly referenceable, hashed by identity, with a backend name."""

    def __init__(self, backend: str) -> None:
        self.backend = backend


def test_a_group_at_a_reused_address_is_not_served_a_stale_backend(monkeypatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group: group.backend)
    first = _FakeGroup("gloo")
    address = id(first)
    assert _group_cache.waits_on_cpu(first)
    del first
    gc.collect()
    held = []  # keep misses alive so the allocator moves on to the freed address
    for _ in range(10_000):
        second = _FakeGroup("nccl")
        if id(second) == address:
            break
        held.append(second)
    else:
        pytest.skip("the allocator did not reuse the address")
    assert not _group_cache.waits_on_cpu(second)  # an id(group)-keyed cache answered True here


def test_forget_drops_one_group_or_all(monkeypatch) -> None:
    monkeypatch.setattr(dist, "get_backend", lambda group: group.backend)
    a, b = _FakeGroup("gloo"), _FakeGroup("gloo")
    _group_cache.waits_on_cpu(a)
    _group_cache.waits_on_cpu(b)
    _group_cache.forget(a)
    assert a not in _group_cache._waits_on_cpu and b in _group_cache._waits_on_cpu
    _group_cache.forget()
    assert len(_group_cache._waits_on_cpu) == 0
