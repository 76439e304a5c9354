"""The mmap indexed dataset: round trips in every dtype, documents, merging, slicing; DeepSpeed 0.19.8's files
(recorded in `fixtures/data_sampling`) read back, and ours written byte for byte like them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ds_engine._data.index_utils import find_fit_int_dtype, split_index
from ds_engine._data.indexed_dataset import DTYPE_CODES, MMapIndexedDataset, MMapIndexedDatasetBuilder, code

FIXTURES = Path(__file__).parent / "fixtures" / "data_sampling"
RECORDED = json.loads((FIXTURES / "deepspeed_data_sampling.json").read_text())["analyzer_files"]


@pytest.mark.parametrize("dtype_code", sorted(DTYPE_CODES))
def test_round_trip_in_every_dtype(dtype_code: int, tmp_path: Path) -> None:
    np_dt = DTYPE_CODES[dtype_code][0]
    rng = np.random.default_rng(dtype_code)
    items = [rng.integers(0, 100, size=n).astype(np_dt) for n in (3, 0, 7, 1)]
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "d.bin"), dtype=np_dt)
    builder.add_item(torch.from_numpy(items[0].astype(np.int64)))
    builder.add_items(items[1:3])
    builder.end_document()
    builder.add_item_numpy(items[3])
    builder.end_document()
    builder.finalize(str(tmp_path / "d.idx"))
    ds = MMapIndexedDataset(str(tmp_path / "d"))
    assert len(ds) == 4 and ds.dtype is np_dt and code(np_dt) == dtype_code
    assert [x.tolist() for x in ds[0:4]] == [x.tolist() for x in items]
    assert ds[np.int64(2)].tolist() == items[2].tolist() and ds[-1].tolist() == items[3].tolist()
    assert ds.sizes.tolist() == [3, 0, 7, 1] and ds.doc_idx.tolist() == [0, 3, 4]
    assert ds.get(2, offset=2, length=3).tolist() == items[2][2:5].tolist()
    with pytest.raises(IndexError):
        ds[4]


def test_merge_appends_items_and_documents(tmp_path: Path) -> None:
    for name, rows in (("a", [[1, 2], [3]]), ("b", [[4, 5, 6]])):
        builder = MMapIndexedDatasetBuilder(str(tmp_path / f"{name}.bin"), dtype=np.uint16)
        for row in rows:
            builder.add_item_numpy(np.array(row))
        builder.end_document()
        builder.finalize(str(tmp_path / f"{name}.idx"))
    merged = MMapIndexedDatasetBuilder(str(tmp_path / "m.bin"), dtype=np.uint16)
    merged.merge_file_(str(tmp_path / "a"))
    merged.merge_file_(str(tmp_path / "b"))
    merged.finalize(str(tmp_path / "m.idx"))
    ds = MMapIndexedDataset(str(tmp_path / "m"), skip_warmup=True)
    assert [x.tolist() for x in ds] == [[1, 2], [3], [4, 5, 6]] and ds.doc_idx.tolist() == [0, 2, 3]
    wrong = MMapIndexedDatasetBuilder(str(tmp_path / "w.bin"), dtype=np.int64)
    with pytest.raises(ValueError, match="differs from the builder's"):
        wrong.merge_file_(str(tmp_path / "a"))


def test_deepspeeds_files_read_back_and_ours_are_the_same_bytes(tmp_path: Path) -> None:
    for suffix in ("bin", "idx"):
        (tmp_path / f"seqlen_index_to_sample.{suffix}").write_bytes(
            bytes.fromhex(RECORDED[f"seqlen/seqlen_index_to_sample.{suffix}"])
        )
    theirs = MMapIndexedDataset(str(tmp_path / "seqlen_index_to_sample"), skip_warmup=True)
    rows = [r.copy() for r in theirs]
    assert theirs.dtype is np.uint8 and sum(len(r) for r in rows) == 120
    builder = MMapIndexedDatasetBuilder(str(tmp_path / "ours.bin"), dtype=theirs.dtype)
    boundaries = theirs.doc_idx.tolist()[1:]  # DeepSpeed's reduce merges pieces: [0, end of piece 0, N, N]
    for k, r in enumerate(rows):
        builder.add_item_numpy(r)
        while boundaries and boundaries[0] == k + 1:
            builder.end_document()
            boundaries.pop(0)
    builder.finalize(str(tmp_path / "ours.idx"))
    for suffix in ("bin", "idx"):
        assert (tmp_path / f"ours.{suffix}").read_bytes() == (
            tmp_path / f"seqlen_index_to_sample.{suffix}"
        ).read_bytes()


def test_bad_dtype_and_bad_index_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot be stored in an indexed dataset"):
        MMapIndexedDatasetBuilder(str(tmp_path / "f.bin"), dtype=np.float32)
    (tmp_path / "x.idx").write_bytes(b"TNTIDX\x00\x00" + bytes(40))
    (tmp_path / "x.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not an mmap indexed-dataset index"):
        MMapIndexedDataset(str(tmp_path / "x"))


def test_helpers() -> None:
    assert find_fit_int_dtype(0, 255) is np.uint8 and find_fit_int_dtype(0, 256) is np.uint16
    assert find_fit_int_dtype(-1, 127) is np.int8 and find_fit_int_dtype(-129, 0) is np.int16
    assert find_fit_int_dtype(0, 2**40) is np.uint64 and find_fit_int_dtype(-(2**40), 0) is np.int64
    assert split_index(0, 10, 3) == [(0, 3), (3, 6), (6, 10)] and split_index(5, 5, 2) == [(5, 5), (5, 5)]


def test_megatron_style_helpers_on_deepspeeds_path(tmp_path: Path) -> None:
    from ds_engine.runtime.data_pipeline.data_sampling import indexed_dataset as ids

    builder = ids.make_builder(str(tmp_path / "tok.bin"), impl="mmap", vocab_size=50000)
    builder.add_item(torch.tensor([5, 49999]))
    builder.end_document()
    builder.finalize(str(tmp_path / "tok.idx"))
    assert ids.infer_dataset_impl(str(tmp_path / "tok")) == "mmap" and ids.dataset_exists(str(tmp_path / "tok"), "mmap")
    ds = ids.make_dataset(str(tmp_path / "tok"), "infer", skip_warmup=True)
    assert ds is not None and ds.dtype is np.uint16 and ds[0].tolist() == [5, 49999]
    assert ids.make_dataset(str(tmp_path / "none"), "mmap") is None
    with pytest.raises(ValueError, match="'lazy': ds implements the 'mmap' indexed dataset only"):
        ids.make_builder(str(tmp_path / "x.bin"), impl="lazy")
