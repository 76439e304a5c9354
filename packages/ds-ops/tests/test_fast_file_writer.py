"""`FastFileWriter`: `torch.save` through single and double aligned buffers leaves torch.save's exact bytes.

The reference is `torch.save(obj, BytesIO)`: torch names a zip archive after a file path it is given, and
`archive` for a file object, which is what every writer here is.
"""

from __future__ import annotations

import io
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_ops.aio import AioError, AsyncIOHandle
from ds_ops.fast_io import (
    DoubleIOBuffer,
    FastFileWriter,
    FastFileWriterConfig,
    MockFileWriter,
    PyFileWriter,
    SingleIOBuffer,
)


def _objects() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "tensor": torch.randn(70_001, generator=g),  # not a multiple of any buffer size
        "state": {
            "w": torch.randn(64, 33, generator=g).half(),
            "shared": (lambda t: [t, t[3:9]])(torch.arange(1000)),  # storage shared by two views
            "meta": {"step": 7, "name": "x" * 5000},
        },
        "tiny": torch.tensor([1.5]),  # the whole stream fits in one buffer
        "empty": {},
    }


def _torch_bytes(obj: Any, **kwargs: Any) -> bytes:
    ref = io.BytesIO()
    torch.save(obj, ref, **kwargs)
    return ref.getvalue()


@pytest.fixture(scope="module")
def handle() -> AsyncIOHandle:
    with AsyncIOHandle(block_size=1 << 16, queue_depth=4) as h:
        yield h


def _config(handle: AsyncIOHandle, nbytes: int, double: bool, **kwargs: Any) -> FastFileWriterConfig:
    buffer = handle.new_cpu_locked_tensor(nbytes, torch.empty(0, dtype=torch.uint8))
    return FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=buffer, double_buffer=double, **kwargs)


@pytest.mark.parametrize("double", [False, True], ids=["single", "double"])
@pytest.mark.parametrize("nbytes", [2 * 4096, 64 * 1024, 4 << 20])
@pytest.mark.parametrize("name", list(_objects()))
def test_file_equals_torch_save(handle: AsyncIOHandle, tmp_path: Path, double: bool, nbytes: int, name: str) -> None:
    obj = _objects()[name]
    path = tmp_path / "f.pt"
    path.write_bytes(b"stale content longer than nothing" * 10_000)  # a writer of its own truncates
    writer = FastFileWriter(path, _config(handle, nbytes, double))
    torch.save(obj, writer)
    writer.close()
    assert path.read_bytes() == _torch_bytes(obj)
    stats = writer.stats()
    assert stats["bytes"] == writer.stream_num_bytes == path.stat().st_size
    assert stats["aio_bytes"] == path.stat().st_size  # every byte went through the async I/O op


def test_legacy_format_and_reload(handle: AsyncIOHandle, tmp_path: Path) -> None:
    obj = _objects()["state"]
    writer = FastFileWriter(tmp_path / "legacy.pt", _config(handle, 8192, True))
    torch.save(obj, writer, _use_new_zipfile_serialization=False)
    writer.close()
    assert (tmp_path / "legacy.pt").read_bytes() == _torch_bytes(obj, _use_new_zipfile_serialization=False)
    back = torch.load(tmp_path / "legacy.pt", weights_only=False)
    assert torch.equal(back["w"], obj["w"]) and back["meta"] == obj["meta"]


@pytest.mark.parametrize("writers", [2, 3])
def test_parallel_writers_stripe_one_file(handle: AsyncIOHandle, tmp_path: Path, writers: int) -> None:
    """N writers of the same stream, each writing only its stripes, leave the file one writer would."""
    obj = _objects()["tensor"]
    path = tmp_path / "par.pt"
    path.touch()
    seen = []
    for rank in range(writers):
        w = FastFileWriter(path, _config(handle, 2 * 4096, True, num_parallel_writers=writers, writer_rank=rank))
        torch.save(obj, w)
        w.close()
        seen.append((w.stream_num_bytes, w.stream_tail_digest(), w.stats()["aio_bytes"]))
    expected = _torch_bytes(obj)
    assert path.read_bytes() == expected
    assert {(n, d) for n, d, _ in seen} == {(len(expected), seen[0][1])}
    assert sum(moved for _, _, moved in seen) == len(expected)  # no byte written twice
    assert all(moved < len(expected) for _, _, moved in seen)


def test_parallel_writer_needs_the_callers_file(handle: AsyncIOHandle, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="parallel writers"):
        FastFileWriter(tmp_path / "nope.pt", _config(handle, 8192, True, num_parallel_writers=2, writer_rank=1))


def test_write_failure_raises_naming_the_file(handle: AsyncIOHandle, tmp_path: Path) -> None:
    path = tmp_path / "gone" / "f.pt"
    path.parent.mkdir()
    writer = FastFileWriter(path, _config(handle, 8192, False))
    path.parent.joinpath("f.pt").unlink()
    path.parent.rmdir()
    with pytest.raises(Exception) as caught:  # noqa: PT011 - torch may wrap the writer's error in its own
        torch.save(torch.randn(10_000), writer)
    chain, err = [], caught.value
    while err is not None:
        chain.append(err)
        err = err.__context__
    assert any(isinstance(e, AioError) and "f.pt" in str(e) for e in chain), chain
    writer.close()  # releases without raising again


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_parallel_writers": 2, "writer_rank": 2}, "writer_rank=2"),
        ({"num_parallel_writers": 0}, "num_parallel_writers"),
        ({"writer_rank": -1}, "writer_rank=-1"),
    ],
)
def test_bad_config_is_named(handle: AsyncIOHandle, tmp_path: Path, kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FastFileWriter(tmp_path / "f.pt", _config(handle, 8192, True, **kwargs))


def test_buffer_sizes_are_checked(handle: AsyncIOHandle, tmp_path: Path) -> None:
    odd = FastFileWriterConfig(dnvme_handle=handle, pinned_tensor=torch.zeros(4096, dtype=torch.uint8))
    with pytest.raises(ValueError, match="double_buffer=True.*8192"):
        FastFileWriter(tmp_path / "f.pt", odd)
    with pytest.raises(ValueError, match="uint8"):
        SingleIOBuffer(torch.zeros(1024, dtype=torch.float32), handle)
    with pytest.raises(TypeError, match="dnvme_handle"):
        FastFileWriter(tmp_path / "f.pt", FastFileWriterConfig(dnvme_handle=None, pinned_tensor=torch.zeros(8192)))


def test_double_buffer_overlaps_one_request(handle: AsyncIOHandle, tmp_path: Path) -> None:
    """The double buffer keeps one write in flight while the other half fills; the single one waits at once."""
    memory = handle.new_cpu_locked_tensor(4 * 4096, torch.empty(0, dtype=torch.uint8))
    data = torch.arange(3 * 8192, dtype=torch.int64).to(torch.uint8)
    path = tmp_path / "d.bin"
    path.touch()
    double = DoubleIOBuffer(memory, handle)
    assert double.capacity == 8192
    for stripe in range(3):
        assert double.fill(data, stripe * 8192) == 8192
        double.drain(path, stripe * 8192)
        assert not double.is_empty()  # its request may still be in flight
    double.complete_ongoing_drain()
    assert double.is_empty()
    assert path.read_bytes() == bytes(data.numpy())


def test_py_and_mock_writers(tmp_path: Path) -> None:
    obj = _objects()["state"]
    py = PyFileWriter(tmp_path / "py.pt")
    torch.save(obj, py)
    py.close()
    assert (tmp_path / "py.pt").read_bytes() == _torch_bytes(obj)
    mock = MockFileWriter(tmp_path / "mock.pt")
    torch.save(obj, mock)
    mock.close()
    assert os.path.getsize(tmp_path / "mock.pt") == 0
    assert mock.stats()["bytes"] == len(_torch_bytes(obj)) == py.stats()["bytes"]
    assert py.fileno() == -1


def test_storage_object_list_writes_torchs_legacy_layout(handle: AsyncIOHandle, tmp_path: Path) -> None:
    """`save_torch_storage_object_list` (the hook a FastPersist-patched torch calls) writes each storage's bytes,
    after its 8-byte little-endian element count with `save_size`."""
    a, b = torch.arange(5, dtype=torch.int64), torch.tensor([1.5, -2.0], dtype=torch.float16)
    writer = FastFileWriter(tmp_path / "s.bin", _config(handle, 8192, True))
    taken = writer.save_torch_storage_object_list(
        [(a.untyped_storage(), torch.int64), (b.untyped_storage(), torch.float16)], True
    )
    writer.close()
    expected = (
        (5).to_bytes(8, "little") + bytes(a.numpy()) + (2).to_bytes(8, "little") + bytes(b.view(torch.int16).numpy())
    )
    assert taken == len(expected) and (tmp_path / "s.bin").read_bytes() == expected
    assert writer.stats()["save_storage"] == 2 and writer.stats()["save_storage_bytes"] == 40 + 4
