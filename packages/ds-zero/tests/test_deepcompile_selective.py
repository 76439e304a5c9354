"""Selective unsharding's budget and choice (`ds_zero._compile.selective`), without ranks.

The end-to-end runs (parameters kept whole after the warm-up, the recompiled graphs without their
gathers, losses equal to eager ZeRO-3) are in ds-engine's `tests/dist/test_dist_deepcompile.py`.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from ds_zero._compile import selective


def _param(numel: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    p = nn.Parameter(torch.empty(0, dtype=dtype))
    p.ds_numel = numel  # type: ignore[attr-defined]
    return p


class _Accelerator:
    def __init__(self, name: str, *, total: int, peak: int, available: int) -> None:
        self.name, self.total, self.peak, self.available = name, total, peak, available

    def device_name(self, device_index: Any = None) -> str:
        return self.name

    def total_memory(self) -> int:
        return self.total

    def max_memory_allocated(self) -> int:
        return self.peak

    def available_memory(self) -> int:
        return self.available


def test_smallest_first_prefix_that_fits() -> None:
    params = [("w1", _param(100)), ("b1", _param(10)), ("w2", _param(50)), ("b2", _param(10, torch.bfloat16))]
    chosen, plan = selective.choose_whole(params, headroom_bytes=40 + 20 + 200)
    # bytes: w1 400, b1 40, w2 200, b2 20 -> b2, b1, w2 fit (260), w1 does not
    assert [name for name, _ in chosen] == ["b2", "b1", "w2"]
    assert plan.chosen == ("b2", "b1", "w2") and plan.chosen_bytes == 260
    assert plan.candidates == 4 and plan.candidate_bytes == 660
    assert plan.line().startswith("selective unsharding: 3 of 4 partitioned parameters kept whole")


def test_the_first_that_does_not_fit_ends_the_choice() -> None:
    params = [("a", _param(10)), ("b", _param(20)), ("c", _param(30))]
    chosen, _ = selective.choose_whole(params, headroom_bytes=40 + 120)  # a (40) and b (80) fit, c (120) not after them
    assert [name for name, _ in chosen] == ["a", "b"]
    chosen, plan = selective.choose_whole(params, headroom_bytes=39)
    assert chosen == [] and plan.chosen_bytes == 0
    ties = [("x", _param(8)), ("y", _param(8))]
    assert [n for n, _ in selective.choose_whole(ties, 32)[0]] == ["x"]  # equal sizes: the earlier first


def test_cpu_headroom_is_the_host_share_less_the_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    gib = 2**30
    acc = _Accelerator("cpu", total=20 * gib, peak=3 * gib, available=16 * gib)
    assert selective.memory_headroom(acc) == int(20 * gib * 0.9) // 2 - 3 * gib  # 6 GiB
    acc.available = 4 * gib  # the host is busy: never more than the free memory, shared
    assert selective.memory_headroom(acc) == 2 * gib
    acc.peak = 10 * gib
    assert selective.memory_headroom(acc) == 0
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.setenv("LOCAL_SIZE", "4")  # the MPI runners' name
    acc.peak, acc.available = 1 * gib, 16 * gib
    assert selective.memory_headroom(acc) == int(20 * gib * 0.9) // 4 - 1 * gib


def test_device_headroom_is_deepspeeds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # one device per rank: the host's ranks do not divide it
    acc = _Accelerator("cuda", total=80 * 2**30, peak=30 * 2**30, available=0)
    assert selective.memory_headroom(acc) == int(80 * 2**30 * 0.9) - 30 * 2**30


def test_keep_whole_marks_and_gathers_once() -> None:
    calls: list[tuple[list[nn.Parameter], str]] = []
    stage3 = SimpleNamespace(coordinator=SimpleNamespace(refresh=lambda ps, label: calls.append((ps, label))))
    params = [_param(4), _param(6)]
    for p in params:
        p.ds_persist = False  # type: ignore[attr-defined]
    selective.keep_whole(stage3, params)
    assert all(p.ds_persist for p in params)  # type: ignore[attr-defined]
    assert len(calls) == 1 and calls[0][0] == params
    selective.keep_whole(stage3, [])
    assert len(calls) == 1  # nothing chosen: no collective
