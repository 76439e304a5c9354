"""`UlyssesSPDataLoaderAdapter` yields DeepSpeed's batches: every `[batch, seq]` tensor cut to this rank's
shard, `labels` replaced by `shift_labels` shifted on the whole sequence (the shard boundary keeps its
target), user `position_ids` and `attention_mask` sharded as they are, non-tensors as the loading rank had
them; it is its own iterator (iteration continues, an epoch ends with one StopIteration); bad batches are
refused before any communication.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks
from ds_parallel.ulysses_sp import UlyssesSPDataLoaderAdapter


def loaded(rank: int) -> dict[str, Any]:
    """Rank `rank`'s batch: two samples of 8 tokens, packed positions (two documents), an SFT-style label mask."""
    ids = torch.arange(16).view(2, 8) + 100 * rank
    labels = ids.clone()
    labels[:, :2] = -100  # prompt tokens
    return {
        "input_ids": ids,
        "labels": labels,
        "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]] * 2),
        "attention_mask": torch.ones(2, 8, dtype=torch.long),
        "source": f"rank{rank}",
    }


def _iterate(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    adapter = UlyssesSPDataLoaderAdapter([loaded(rank)], rank, dist.group.WORLD, world, "cpu")
    first = next(iter(adapter))
    second = next(iter(adapter))  # iter() is the adapter itself: this continues, it does not restart
    with pytest.raises(StopIteration):
        next(adapter)
    again = list(adapter)  # a new epoch
    bare = {"input_ids": torch.arange(8).view(1, 8), "labels": torch.arange(8).view(1, 8)}
    made = next(UlyssesSPDataLoaderAdapter([bare], rank, dist.group.WORLD, world, "cpu"))["position_ids"]
    return {"len": len(adapter), "epoch1": [first, second], "epoch2": again, "made_positions": made}


def test_adapter_yields_deepspeeds_batches() -> None:
    world, chunk = 2, 4
    results = run_ranks(world, _iterate, timeout_s=60)
    for rank, res in enumerate(results):
        assert res["len"] == world
        for epoch in (res["epoch1"], res["epoch2"]):
            assert len(epoch) == world
            for source, mb in enumerate(epoch):  # micro-batch k is rank k's batch
                whole = loaded(source)
                lo, hi = rank * chunk, (rank + 1) * chunk
                shifted = torch.cat([whole["labels"][:, 1:], torch.full((2, 1), -100)], dim=1)
                assert sorted(mb) == ["attention_mask", "input_ids", "position_ids", "shift_labels", "source"]
                torch.testing.assert_close(mb["input_ids"], whole["input_ids"][:, lo:hi], atol=0, rtol=0)
                torch.testing.assert_close(mb["shift_labels"], shifted[:, lo:hi], atol=0, rtol=0)
                torch.testing.assert_close(mb["position_ids"], whole["position_ids"][:, lo:hi], atol=0, rtol=0)
                torch.testing.assert_close(mb["attention_mask"], whole["attention_mask"][:, lo:hi], atol=0, rtol=0)
                assert mb["source"] == f"rank{source}"
                assert mb["shift_labels"].dtype == whole["labels"].dtype
    # Without position_ids each sample's are 0..seq-1, cut like the rest (ds; DeepSpeed requires them).
    assert [r["made_positions"].tolist() for r in results] == [[[0, 1, 2, 3]], [[4, 5, 6, 7]]]
    # The shard boundary: rank 0's last target is rank 1's first token, not -100.
    assert results[0]["epoch1"][1]["shift_labels"][:, -1].tolist() == [104, 112]
    assert results[1]["epoch1"][1]["shift_labels"][:, -1].tolist() == [-100, -100]


@pytest.mark.parametrize(
    ("batch", "error", "match"),
    [
        ({"input_ids": torch.zeros(1, 8, dtype=torch.long)}, ValueError, "no 'labels'"),
        (
            {"input_ids": torch.zeros(1, 8), "labels": torch.zeros(1, 8), "extra": torch.zeros(1, 7)},
            ValueError,
            r"extra's shape \(1, 7\) must match input_ids's shape \(1, 8\)",
        ),
        ([torch.zeros(1, 8)], TypeError, "dicts with 'input_ids'"),
    ],
)
def test_adapter_refuses_bad_batches_before_communicating(batch: Any, error: type, match: str) -> None:
    adapter = UlyssesSPDataLoaderAdapter([batch], 0, None, 2, "cpu")  # no process group: nothing is sent
    with pytest.raises(error, match=match):
        next(adapter)
