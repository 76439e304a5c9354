"""`ds_zero._checkpoint.hf_shards`: a state_dict written as one weights file or as Hugging Face shards + index."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from ds_zero._checkpoint.hf_shards import parse_shard_size, split_into_shards, write_state_dict_dir


def _state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tied = torch.randn(8, 4)  # 128 bytes, under two names
    return {
        "embed.weight": tied,
        "a.weight": torch.randn(4, 4),  # 64 bytes
        "a.bias": torch.randn(4),  # 16 bytes
        "head.weight": tied,
        "big": torch.randn(64),  # 256 bytes: over the limit used below, a shard of its own
        "steps": torch.tensor(3),
    }


@pytest.mark.parametrize(
    ("given", "expected"),
    [("5GB", 5 * 10**9), ("500MiB", 500 * 2**20), ("1.5kb", 1500), ("100", 100), (2048, 2048), (None, None)],
)
def test_shard_sizes_in_hugging_face_spellings(given: object, expected: int | None) -> None:
    assert parse_shard_size(given) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", ["5 parsecs", "", "-1GB", 0, True, 1.5])
def test_bad_shard_size_names_the_argument(bad: object) -> None:
    with pytest.raises(ValueError, match="max_shard_size"):
        parse_shard_size(bad)  # type: ignore[arg-type]


def test_tied_tensors_share_a_shard_and_count_once() -> None:
    shards = split_into_shards(_state(), 200)
    # 128 (tied, once) + 64 fit in 200; a.bias would overflow; big alone; steps would overflow big's shard
    assert shards == [["embed.weight", "a.weight", "head.weight"], ["a.bias"], ["big"], ["steps"]]
    assert split_into_shards(_state(), None) == [list(_state())]


def test_one_file_when_it_fits_keeps_ties(tmp_path: Path) -> None:
    state = _state()
    written = write_state_dict_dir(state, tmp_path / "out", max_shard_size="5GB")
    assert written == [tmp_path / "out" / "pytorch_model.bin"]
    loaded = torch.load(written[0], weights_only=True)
    assert list(loaded) == list(state) and all(torch.equal(loaded[k], v) for k, v in state.items())
    assert loaded["embed.weight"] is loaded["head.weight"]


def test_shards_and_index_cover_every_tensor(tmp_path: Path) -> None:
    state = _state()
    out = tmp_path / "out"
    written = write_state_dict_dir(state, out, max_shard_size=200)
    names = [p.name for p in written]
    assert names == [f"pytorch_model-0000{i}-of-00004.bin" for i in range(1, 5)] + ["pytorch_model.bin.index.json"]
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert index["metadata"]["total_size"] == 128 + 64 + 16 + 256 + 8
    merged = {}
    for file in sorted(set(index["weight_map"].values())):
        part = torch.load(out / file, weights_only=True)
        assert all(index["weight_map"][k] == file for k in part)
        merged.update(part)
    assert set(merged) == set(state) and all(torch.equal(merged[k], v) for k, v in state.items())
    assert merged["embed.weight"] is merged["head.weight"]


def test_rewrite_with_another_cut_leaves_no_stale_shards(tmp_path: Path) -> None:
    out = tmp_path / "out"
    write_state_dict_dir(_state(), out, max_shard_size=200)
    (out / "README.md").write_text("mine")
    write_state_dict_dir(_state(), out, max_shard_size=None)
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "pytorch_model.bin"]
    write_state_dict_dir(_state(), out, max_shard_size=300)
    assert "pytorch_model.bin" not in {p.name for p in out.iterdir()}


def test_existing_file_is_not_overwritten(tmp_path: Path) -> None:
    target = tmp_path / "weights"
    target.write_text("keep")
    with pytest.raises(NotADirectoryError, match="existing file"):
        write_state_dict_dir(_state(), target)
    assert target.read_text() == "keep"


def test_safetensors_copies_tied_tensors(tmp_path: Path) -> None:
    safetensors = pytest.importorskip("safetensors.torch")
    state = _state()
    written = write_state_dict_dir(state, tmp_path, safe_serialization=True)
    assert written == [tmp_path / "model.safetensors"]
    loaded = safetensors.load_file(str(written[0]))
    assert set(loaded) == set(state) and all(torch.equal(loaded[k], v) for k, v in state.items())


def test_safetensors_missing_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)
    with pytest.raises(ImportError, match="pip install safetensors"):
        write_state_dict_dir(_state(), tmp_path, safe_serialization=True)
