"""`get_optim_files` / `get_model_state_files`: a tag directory's per-rank files, ranks in numeric order."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_zero.zero_to_fp32 import get_model_state_files, get_optim_files


def _touch(folder: Path, names: list[str]) -> None:
    for name in names:
        (folder / name).write_bytes(b"")


def test_ranks_sort_numerically(tmp_path: Path) -> None:
    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (10, 2, 0, 1, 11)]
    _touch(tmp_path, [*names, "mp_rank_00_model_states.pt", "latest_universal"])
    got = get_optim_files(tmp_path)
    assert [Path(p).name for p in got] == [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1, 2, 10, 11)]
    assert all(isinstance(p, str) and Path(p).parent == tmp_path for p in got)
    assert [Path(p).name for p in get_model_state_files(tmp_path)] == ["mp_rank_00_model_states.pt"]


def test_bf16_prefixed_files_count(tmp_path: Path) -> None:
    _touch(
        tmp_path, ["bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    )
    assert [Path(p).name[:20] for p in get_optim_files(tmp_path)] == ["bf16_zero_pp_rank_0_", "bf16_zero_pp_rank_1_"]


def test_missing_files_and_folders_are_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="optim_states.pt"):
        get_optim_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        get_model_state_files(tmp_path / "nope")
