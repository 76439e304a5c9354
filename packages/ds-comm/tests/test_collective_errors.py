"""How a failed collective is classified: a timeout by the exception's type or the time waited, never its wording."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from ds_comm import collectives


@pytest.mark.parametrize(
    ("cause", "waited_s", "expected"),
    [
        (RuntimeError("Timed out waiting 3000ms for recv operation to complete"), 0.1, False),  # wording alone: no
        (RuntimeError("Application timeout caused pair closure"), 0.0, False),  # an earlier timeout's aftermath
        (RuntimeError("Operation timed out!"), 2.0, True),  # what gloo's Work.wait(timeout) raises, at the limit
        (RuntimeError("Connection reset by peer"), 2.0, True),  # any failure after the whole timeout elapsed
        (RuntimeError("Connection reset by peer"), 0.5, False),
        (TimeoutError("deadline"), 0.0, True),
        (dist.DistStoreError("wait timeout after 1000ms"), 0.0, True),
        (dist.DistBackendError("NCCL error"), 0.0, False),
    ],
)
def test_timeouts_are_recognised_by_type_or_time_waited(cause: BaseException, waited_s: float, expected: bool) -> None:
    assert collectives._timed_out(cause, waited_s, timedelta(seconds=2)) is expected


def test_the_shorter_of_the_wait_limit_and_the_group_timeout_counts(monkeypatch) -> None:
    monkeypatch.setattr(collectives.state, "timeout", timedelta(seconds=1))
    # A wait allowed 10 s fails when the process group's own 1 s timeout fires.
    assert collectives._timed_out(RuntimeError("x"), 1.0, timedelta(seconds=10))
    assert not collectives._timed_out(RuntimeError("x"), 0.5, timedelta(seconds=10))
