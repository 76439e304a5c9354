"""The live-parameter pool of stage 3: what `make_room` frees to stay within `max_live_parameters`.

Single process (world size 1, no process group): the gathers are real, the pools are set by hand.
"""

from __future__ import annotations

import torch
from torch import nn

import ds_zero
from ds_zero import ZeroParamStatus
from ds_zero._params.partitioned_param import state_of
from ds_zero._schedule.live import LiveParams


def _three_weights() -> list[nn.Parameter]:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4, bias=False) for _ in range(3)))
    ref = [m.weight.detach().clone() for m in model]
    ds_zero.partition_model(model)
    weights = [m.weight for m in model]
    live = LiveParams(group=None, fp_group=None, max_live_parameters=1000)
    live.gather(weights, "all three", checked=True)
    for w, r in zip(weights, ref, strict=True):
        torch.testing.assert_close(w.data, r, atol=0, rtol=0)
    live.release_unused(weights)
    return weights


def test_make_room_frees_retained_before_prefetched_and_never_a_parameter_in_use() -> None:
    a, b, c = _three_weights()  # 16 elements each
    live = LiveParams(group=None, fp_group=None, max_live_parameters=48)
    live.gather([a, b, c], "all three", checked=True)
    assert live.live_numel == live.peak_live_numel == 48
    live.retained[a.ds_id] = a
    live.prefetched.update({b.ds_id: b, c.ds_id: c})
    state_of(b).active = 1
    avail, gone = ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE
    live.make_room(16)  # 48 + 16 > 48: freeing the retained `a` is enough
    assert [p.ds_status for p in (a, b, c)] == [gone, avail, avail]
    assert live.live_numel == 32 and not live.retained and list(live.prefetched) == [b.ds_id, c.ds_id]
    live.make_room(32)  # `b` is in use: it leaves the pool but stays gathered; `c` goes
    assert [p.ds_status for p in (a, b, c)] == [gone, avail, gone]
    assert live.live_numel == 16 and not live.prefetched and live.peak_live_numel == 48


def test_gather_skips_available_parameters_and_ride_along_joins_the_prefetched_pool() -> None:
    a, b, c = _three_weights()
    live = LiveParams(group=None, fp_group=None, max_live_parameters=1000)
    live.gather([a], "a", checked=True)
    issued = live.num_gathers
    asked: list[int] = []

    def ride_along(need: int) -> tuple[list[nn.Parameter], str]:
        asked.append(need)
        return [c], " and c"

    live.gather([a, b], "a and b", checked=True, ride_along=ride_along)
    assert asked == [16]  # only `b` was missing
    assert live.num_gathers == issued + 1 and live.live_numel == 48
    assert list(live.prefetched) == [c.ds_id] and c.ds_status is ZeroParamStatus.AVAILABLE
    live.claim([c])
    assert not live.prefetched and state_of(c).active == 1


def test_a_parameter_riding_along_with_its_own_gather_is_gathered_and_counted_once() -> None:
    a, b, _ = _three_weights()
    live = LiveParams(group=None, fp_group=None, max_live_parameters=1000)

    def ride_along(need: int) -> tuple[list[nn.Parameter], str]:
        return [a, b], " and the next units"  # the unit ahead is this one again (its backward), plus `b`

    live.gather([a], "a", checked=True, ride_along=ride_along)
    assert a.ds_status is b.ds_status is ZeroParamStatus.AVAILABLE
    assert live.num_param_gathers == 2 and live.live_numel == 32
    assert list(live.prefetched) == [b.ds_id]
    live.release_unused([a, b])
    assert live.live_numel == 0
