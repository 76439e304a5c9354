"""Ranks start from a forkserver whose imports are frozen out of garbage collection (`_forkserver_preload`)."""

from __future__ import annotations

import gc
import sys

from ds_comm.testing import run_ranks


def _rank_view(rank: int, world: int) -> dict[str, object]:
    return {"frozen": gc.get_freeze_count(), "torch_preloaded": "torch" in sys.modules}


def test_each_rank_inherits_the_servers_frozen_imports() -> None:
    (view,) = run_ranks(1, _rank_view, timeout_s=120)
    assert view["torch_preloaded"]
    # torch alone is a few hundred thousand objects; a rank whose server froze nothing reports 0.
    assert view["frozen"] > 100_000, view
