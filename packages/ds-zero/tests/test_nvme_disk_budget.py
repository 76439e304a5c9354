"""How much of the swap disk updates during backward may claim for their spare files (`free_swap_bytes`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ds_zero._nvme import eager_step

GB = 10**9


def _disk(monkeypatch: pytest.MonkeyPatch, *, total: int, free: int) -> None:
    usage = shutil._ntuple_diskusage(total, total - free, free)  # type: ignore[attr-defined]
    monkeypatch.setattr(eager_step.shutil, "disk_usage", lambda path: usage)


@pytest.mark.parametrize(
    ("total", "free", "ranks", "expected"),
    [
        (50 * GB, 10 * GB, "1", 10 * GB - eager_step.DISK_RESERVE_BYTES),  # small disk: the 1 GiB reserve
        (500 * GB, 45 * GB, "1", 40 * GB),  # large disk: 1% of it is kept free
        (500 * GB, 45 * GB, "2", 20 * GB),  # two ranks of this host share the free space
        (50 * GB, GB // 2, "1", 0),  # less free than the reserve: nothing
    ],
)
def test_free_swap_bytes_keeps_a_reserve_and_splits_between_local_ranks(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, total: int, free: int, ranks: str, expected: int
) -> None:
    _disk(monkeypatch, total=total, free=free)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", ranks)
    assert eager_step.free_swap_bytes(tmp_path) == expected


class _Tile:
    def __init__(self, index: int) -> None:
        self.index = index


class _Swapper:
    """What `fitting_on_disk` reads of an `OptimizerSwapper`: the spare bytes each tile still needs."""

    def __init__(self, needs: list[int], path: Path) -> None:
        self.needs, self.dir, self.disk_limit_logged = needs, path, False

    def spare_bytes_needed(self, tile: _Tile) -> int:
        return self.needs[tile.index]


def test_fitting_on_disk_takes_the_longest_prefix_that_fits_and_says_so_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tiles = [_Tile(i) for i in range(4)]
    swapper = _Swapper([0, 3 * GB, 4 * GB, GB], tmp_path)  # tile 0's spare files exist already
    monkeypatch.setattr(eager_step, "free_swap_bytes", lambda path: 6 * GB)
    with caplog.at_level("WARNING", logger=eager_step.__name__):
        assert eager_step.fitting_on_disk(swapper, tiles) == tiles[:2]  # tile 3 would fit, but after tile 2
        assert eager_step.fitting_on_disk(swapper, tiles) == tiles[:2]
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "2 of 4 sub-groups" in warnings[0], warnings
    assert "zero_optimization.offload_optimizer.nvme_path" in warnings[0] and "5.0 GB more" in warnings[0]
    monkeypatch.setattr(eager_step, "free_swap_bytes", lambda path: 8 * GB)
    assert eager_step.fitting_on_disk(swapper, tiles) == tiles
