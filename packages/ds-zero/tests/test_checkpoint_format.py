"""The shared partition checkpoint format: validation messages, consolidation and re-partitioning from
synthetic saves, the file layout helpers and the progress bar."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from ds_zero._checkpoint.format import (
    FORMAT_VERSION,
    FragmentIndex,
    consolidate_fp32_params,
    fill_partition,
    partition_metadata,
    validate_rank_state_dicts,
)
from ds_zero._checkpoint.io import resolve_checkpoint_dir
from ds_zero._checkpoint.partition_files import optim_files
from ds_zero._checkpoint.progress import ProgressBar
from ds_zero._partition import ParamSlot, fragments_in_range, padded_numel

FULL = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.arange(100.0, 105.0)}


def _save(world: int) -> list[dict]:
    """What `world` ranks would save for one group holding w then b (11 elements)."""
    slots = [ParamSlot("w", (2, 3), 0, 6), ParamSlot("b", (5,), 6, 5)]
    flat = torch.cat([FULL["w"].reshape(-1), FULL["b"]])
    part = padded_numel(11, world) // world
    flat = torch.cat([flat, torch.zeros(part * world - 11)])
    out = []
    for r in range(world):
        values = flat[r * part : (r + 1) * part].clone()
        frags = fragments_in_range(slots, r * part, (r + 1) * part)
        out.append(
            {
                "ds_zero_format": FORMAT_VERSION,
                "zero_stage": 2,
                "partition_count": world,
                "dp_rank": r,
                "single_partition_of_fp32_groups": [values],
                "partitions": [partition_metadata(0, part, frags, {"w": (2, 3), "b": (5,)})],
                "base_optimizer_state": {
                    "state": {0: {"exp_avg": values * 2, "step": torch.tensor(3.0)}},
                    "param_groups": [{"lr": 0.1, "params": [0]}],
                },
                "shared_params": {"b_alias": "b"},
            }
        )
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_consolidation_rebuilds_full_tensors(world: int) -> None:
    seen = []
    full = consolidate_fp32_params(_save(world), on_param=lambda name, n: seen.append((name, n)))
    assert torch.equal(full["w"], FULL["w"]) and torch.equal(full["b"], FULL["b"])
    assert full["b_alias"] is full["b"]
    assert seen == [("w", 6), ("b", 5)]


@pytest.mark.parametrize(("old", "new"), [(2, 4), (4, 2), (3, 2), (2, 2)])
def test_fill_partition_repartitions_values_and_state(old: int, new: int) -> None:
    saved = _save(old)
    index = FragmentIndex(saved)
    slots = [ParamSlot("w", (2, 3), 0, 6), ParamSlot("b", (5,), 6, 5)]
    part = padded_numel(11, new) // new
    expected = _save(new)
    for r in range(new):
        dst = torch.full((part,), -1.0)
        frags = fragments_in_range(slots, r * part, (r + 1) * part)
        fill_partition(dst, frags, index, lambda rank, k: saved[rank]["single_partition_of_fp32_groups"][k])
        assert torch.equal(dst, expected[r]["single_partition_of_fp32_groups"][0])
        fill_partition(dst, frags, index, lambda rank, k: saved[rank]["base_optimizer_state"]["state"][k]["exp_avg"])
        assert torch.equal(dst, expected[r]["base_optimizer_state"]["state"][0]["exp_avg"])


def test_validation_messages() -> None:
    saved = _save(2)
    with pytest.raises(ValueError, match="no ZeRO optimizer state dicts"):
        validate_rank_state_dicts([])
    with pytest.raises(ValueError, match=r"all 2 ranks in order .* got dp_ranks \[0\]"):
        validate_rank_state_dicts(saved[:1])
    with pytest.raises(ValueError, match=r"dp_ranks \[1, 0\]"):
        validate_rank_state_dicts(saved[::-1])
    with pytest.raises(ValueError, match=r"missing keys \['ds_zero_format'"):
        validate_rank_state_dicts([{"optimizer": None}])
    newer = dict(saved[0], ds_zero_format=FORMAT_VERSION + 1)
    with pytest.raises(ValueError, match="newer than this ds-zero reads"):
        validate_rank_state_dicts([newer, saved[1]])
    broken = [dict(s) for s in saved]
    broken[1] = dict(broken[1], partitions=[dict(broken[1]["partitions"][0], fragments=[])])
    with pytest.raises(ValueError, match="parameter 'b' .* is not fully covered"):
        consolidate_fp32_params(broken)
    index = FragmentIndex(saved)
    with pytest.raises(ValueError, match="parameter 'other' is not in the checkpoint"):
        fill_partition(
            torch.zeros(3),
            fragments_in_range([ParamSlot("other", (3,), 0, 3)], 0, 3),
            index,
            lambda r, k: saved[r]["single_partition_of_fp32_groups"][k],
        )


def test_optim_file_discovery(tmp_path: Path) -> None:
    for r in (0, 2, 10):
        (tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match=r"ranks \[1, 3, 4, 5, 6, 7, 8, 9\] are missing"):
        optim_files(tmp_path)
    for r in (1, 3, 4, 5, 6, 7, 8, 9):
        (tmp_path / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt").write_bytes(b"")
    assert [p.name.split("_")[3] for p in optim_files(tmp_path)] == [str(r) for r in range(11)]  # natural
    (tmp_path / "bf16_zero_pp_rank_3_mp_rank_00_optim_states.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="two optimizer-state files for rank 3"):
        optim_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a ZeRO checkpoint"):
        optim_files(tmp_path / "..")


def test_checkpoint_dir_resolution(tmp_path: Path) -> None:
    (tmp_path / "step7").mkdir()
    (tmp_path / "latest").write_text("step7")
    assert resolve_checkpoint_dir(tmp_path) == tmp_path / "step7"
    assert resolve_checkpoint_dir(tmp_path, "step7") == tmp_path / "step7"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint_dir(tmp_path, "step8")
    with pytest.raises(FileNotFoundError, match="no 'latest' file"):
        resolve_checkpoint_dir(tmp_path / "step7")


def test_progress_bar_draws_in_place() -> None:
    stream = io.StringIO()
    bar = ProgressBar(2_000_000, label="x", stream=stream, width=10)
    bar.update(1_000_000)
    assert bar.render() == "x [#####-----]  50.0%  1.0M/2.0M"
    bar.update(1_000_000)
    bar.close()
    assert stream.getvalue().startswith("\rx [") and stream.getvalue().endswith("100.0%  2.0M/2.0M\n")
    silent = io.StringIO()
    ProgressBar(5, stream=silent, enabled=False).update(5)
    assert silent.getvalue() == ""
