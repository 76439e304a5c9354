"""`ds_comm.atomic_save` / `atomic_write` / `atomic_write_text`: all of the new file or the old one, never part."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest
import torch

import ds_comm
from ds_comm.testing import file_events


def test_round_trip_and_exact_text(tmp_path: Path) -> None:
    ds_comm.atomic_save({"w": torch.arange(4.0)}, tmp_path / "a.pt")
    torch.testing.assert_close(torch.load(tmp_path / "a.pt")["w"], torch.arange(4.0))
    ds_comm.atomic_save({"w": 1}, tmp_path / "legacy.pt", serialization=False)
    assert torch.load(tmp_path / "legacy.pt") == {"w": 1}
    ds_comm.atomic_write_text(tmp_path / "latest", "global_step7")
    assert (tmp_path / "latest").read_bytes() == b"global_step7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt", "latest", "legacy.pt"]  # no temporaries left


def test_a_failing_writer_leaves_the_old_file_and_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "m.pt"
    ds_comm.atomic_save({"v": 1}, target)

    def half_then_fail(tmp: Path) -> None:
        tmp.write_bytes(b"PK\x03\x04 torn")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        ds_comm.atomic_write(target, half_then_fail)
    assert torch.load(target) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["m.pt"]


def test_events_in_order_and_the_file_appears_only_at_replace(tmp_path: Path) -> None:
    target = tmp_path / "x.txt"
    seen = []

    def hook(event: str, path: Path) -> None:
        seen.append((event, path.exists(), len(list(tmp_path.iterdir()))))

    with file_events(hook):
        ds_comm.atomic_write_text(target, "new")
    assert seen == [
        ("open", False, 0),
        ("write", False, 1),
        ("fsync", False, 1),
        ("replace", False, 1),
        ("fsync_dir", True, 1),
    ]
    ds_comm.atomic_write_text(target, "again")  # the hook is gone again
    assert len(seen) == 5


def test_permissions_follow_the_umask_like_a_plain_save(tmp_path: Path) -> None:
    ds_comm.atomic_save({}, tmp_path / "a.pt")
    torch.save({}, tmp_path / "b.pt")
    assert stat.S_IMODE((tmp_path / "a.pt").stat().st_mode) == stat.S_IMODE((tmp_path / "b.pt").stat().st_mode)


def test_concurrent_writers_of_one_file_never_share_a_temporary(tmp_path: Path) -> None:
    target = tmp_path / "shared.pt"
    temporaries: set[str] = set()
    lock = threading.Lock()
    errors = []

    def writer(i: int) -> None:
        def write(tmp: Path) -> None:
            with lock:
                assert tmp.name not in temporaries
                temporaries.add(tmp.name)
            torch.save({"writer": i, "data": torch.full((1000,), float(i))}, tmp)

        try:
            for _ in range(5):
                ds_comm.atomic_write(target, write)
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    final = torch.load(target)
    assert torch.equal(final["data"], torch.full((1000,), float(final["writer"])))  # one writer's whole file
    assert len(temporaries) == 20 and os.listdir(tmp_path) == ["shared.pt"]
