"""`zero_optimization.overlap_comm` at stage 3: true (the default) keeps a bucket's gradient reduce-scatter in
flight while backward goes on; false waits for each as it is issued. Both train to bit-identical weights.

Two gloo ranks; the reduce-scatters are recorded as they are issued and waited for.
"""

from __future__ import annotations

import pytest
import torch
from stage3_cases import reduce_scatter_order

from ds_comm.testing import run_ranks


def _overlapped(events: list[tuple[str, int]]) -> int:
    """How many reduce-scatters were issued while an earlier one was still not waited for."""
    pending: set[int] = set()
    count = 0
    for kind, index in events:
        if kind == "issue":
            count += bool(pending)
            pending.add(index)
        else:
            pending.discard(index)
    return count


@pytest.mark.timeout(300)
def test_overlap_comm_decides_whether_reduce_scatters_overlap() -> None:
    on = run_ranks(2, reduce_scatter_order, overlap_comm=True, timeout_s=240)
    off = run_ranks(2, reduce_scatter_order, overlap_comm=False, timeout_s=240)
    for rank in range(2):
        issued = [i for kind, i in on[rank]["events"] if kind == "issue"]
        assert len(issued) > 6  # several buckets per backward (reduce_bucket_size 4000)
        assert _overlapped(on[rank]["events"]) > 0
        assert [i for kind, i in off[rank]["events"] if kind == "issue"] == issued  # the same collectives
        assert _overlapped(off[rank]["events"]) == 0
        for index, (kind, i) in enumerate(off[rank]["events"]):  # each waited right after it is issued
            assert (kind, i) == (("issue", index // 2) if index % 2 == 0 else ("wait", index // 2))
        assert on[rank]["losses"] == off[rank]["losses"]
        for key, value in on[rank]["state"].items():
            assert torch.equal(off[rank]["state"][key], value), key
