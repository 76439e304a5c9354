"""Every way a request can fail is an `AioError` naming the file, the offset and the bytes expected and
done, raised by wait() once everything settled: unwritable paths, a full disk (a 1 MiB tmpfs as root;
RLIMIT_FSIZE unprivileged), truncated files, a file system refusing O_DIRECT. Bad arguments are
ValueError/TypeError before any work."""

from __future__ import annotations

import errno
import logging
import os
import textwrap
from pathlib import Path

import pytest
import torch
from _aio_helpers import ENGINES, mounted, random_bytes
from _toy_ops import run_python, subprocess_env

from ds_ops.aio import AioError, AsyncIOHandle


def test_unwritable_path_under_a_regular_file(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"x")
    bad = tmp_path / "plain" / "swap.bin"
    handle = AsyncIOHandle()
    good = random_bytes(5000, seed=1)
    handle.async_pwrite(good, tmp_path / "ok.bin")  # settles normally next to the failure
    handle.async_pwrite(random_bytes(5000, seed=2), bad, file_offset=4096)
    with pytest.raises(AioError) as info:
        handle.wait()
    message = str(info.value)
    assert f"aio write of 5000 bytes at offset 4096 of {str(bad)!r} failed after 0 bytes" in message
    assert "cannot open the file for writing" in message and "ENOTDIR" in message
    assert info.value.errno == errno.ENOTDIR and info.value.filename == str(bad)
    assert isinstance(info.value, OSError)
    back = torch.empty_like(good)
    handle.sync_pread(back, tmp_path / "ok.bin")  # the handle still works
    assert torch.equal(back, good)


def test_missing_file_and_directory(tmp_path: Path) -> None:
    handle = AsyncIOHandle()
    handle.async_pread(torch.empty(10), tmp_path / "nope.bin")
    handle.async_pwrite(torch.empty(10), tmp_path / "no_dir" / "x.bin")
    with pytest.raises(AioError, match=r"ENOENT.*\(and 1 more failed request\(s\): .*no_dir/x.bin") as info:
        handle.wait()
    assert len(info.value.failures) == 2 and "cannot open the file for reading" in info.value.failures[0]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("use_o_direct", [True, False], ids=["direct", "buffered"])
def test_truncated_file_is_a_short_read(tmp_path: Path, engine: str, use_o_direct: bool) -> None:
    handle = AsyncIOHandle(block_size=64 * 1024, intra_op_parallelism=2, use_o_direct=use_o_direct, engine=engine)
    path = tmp_path / "swap.bin"
    nbytes = (1 << 20) + 100
    handle.sync_pwrite(random_bytes(nbytes, seed=0), path)
    os.truncate(path, 500_000)
    with pytest.raises(AioError) as info:
        handle.sync_pread(torch.empty(nbytes, dtype=torch.uint8), path)
    message = str(info.value)
    assert f"of {str(path)!r}" in message
    assert f"short read: expected {nbytes} bytes, got 500000 (the file has 500000 bytes: truncated" in message
    assert info.value.errno == errno.ENODATA and info.value.bytes_done <= 500_000
    # Reading past the end at an offset is the same error.
    with pytest.raises(AioError, match="at offset 499999 .* short read: expected 2 bytes, got 1"):
        handle.sync_pread(torch.empty(2, dtype=torch.uint8), path, file_offset=499_999)


def test_disk_full_rlimit_fsize_unprivileged(tmp_path: Path) -> None:
    """RLIMIT_FSIZE in a child (no privileges needed): writing past it is EFBIG, named with the file."""
    script = textwrap.dedent("""
        import resource, sys, torch
        from ds_ops.aio import AioError, AsyncIOHandle
        from _aio_helpers import IO_URING_OK
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        for engine in ["psync"] + (["io_uring"] if IO_URING_OK else []):
            for direct in (True, False):
                path = f"{sys.argv[1]}/{engine}_{direct}.bin"
                handle = AsyncIOHandle(block_size=256 * 1024, use_o_direct=direct, engine=engine)
                try:
                    handle.sync_pwrite(torch.ones(2 << 20, dtype=torch.uint8), path)
                except AioError as err:
                    print("ERR", engine, direct, err.errno, err.bytes_done, "|", err)
                else:
                    print("NO ERROR", engine, direct)
    """)
    out = run_python(script, subprocess_env(), args=(str(tmp_path),)).stdout
    lines = [line for line in out.splitlines() if line.startswith(("ERR", "NO ERROR"))]
    assert lines and all(line.startswith("ERR") for line in lines), out
    for line in lines:
        _, engine, direct, code, done, message = line.split(" ", 5)
        assert int(code) == errno.EFBIG, line
        assert int(done) == 1 << 20, line  # everything up to the limit was written
        assert f"{tmp_path}/{engine}_{direct}.bin" in message and "file size limit" in message, line


@pytest.mark.parametrize("use_o_direct", [None, False], ids=["where_allowed", "buffered"])
def test_disk_full_small_tmpfs(tmp_path: Path, use_o_direct: bool | None) -> None:
    with mounted(tmp_path / "mnt", "tmpfs", "size=1m") as mnt:
        handle = AsyncIOHandle(block_size=128 * 1024, intra_op_parallelism=2, use_o_direct=use_o_direct)
        with pytest.raises(AioError) as info:
            handle.sync_pwrite(random_bytes(3 << 20, seed=5), mnt / "full.bin")
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(mnt / "full.bin")
        assert "the file system is full" in str(info.value) and 0 < info.value.bytes_done < 3 << 20


def test_read_only_file_system(tmp_path: Path) -> None:
    with mounted(tmp_path / "ro", "tmpfs", "size=1m,ro") as mnt:
        with pytest.raises(AioError, match="read-only") as info:
            AsyncIOHandle().sync_pwrite(torch.ones(10), mnt / "x.bin")
        assert info.value.errno == errno.EROFS
        with pytest.raises(AioError, match="cannot probe O_DIRECT"):
            AsyncIOHandle().uses_o_direct(mnt / "x.bin")


def test_file_system_refusing_o_direct(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """ramfs has no O_DIRECT: required -> AioError saying how to turn it off; where-allowed -> buffered,
    logged once, same bytes."""
    with mounted(tmp_path / "ram", "ramfs", "size=4m") as mnt:
        path = mnt / "x.bin"
        source = random_bytes(100_000, seed=9)
        with pytest.raises(AioError, match="refuses O_DIRECT.*use_o_direct=False") as info:
            AsyncIOHandle(use_o_direct=True).sync_pwrite(source, path)
        assert info.value.filename == str(path)
        handle = AsyncIOHandle()
        assert not handle.uses_o_direct(path)
        with caplog.at_level(logging.WARNING, logger="ds_ops.aio._handle"):
            handle.sync_pwrite(source, path)
            back = torch.empty_like(source)
            handle.sync_pread(back, path)
        assert torch.equal(back, source) and handle.num_bytes_direct == 0
        assert sum("refuses O_DIRECT" in r.getMessage() for r in caplog.records) == 1


def test_a_forked_child_is_told_to_make_its_own_handle(tmp_path: Path) -> None:
    handle = AsyncIOHandle()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report the error text and leave without running any cleanup
        try:
            handle.async_pwrite(torch.ones(4), tmp_path / "child.bin")
            text = "no error"
        except ValueError as err:
            text = str(err)
        os.write(write_end, text.encode())
        os._exit(0)
    os.close(write_end)
    os.waitpid(pid, 0)
    text = os.read(read_end, 4096).decode()
    os.close(read_end)
    assert "created in process" in text and "create a handle per process" in text, text
    handle.sync_pwrite(torch.ones(4), tmp_path / "parent.bin")  # the parent's handle is unaffected


def test_bad_arguments_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"block_size=0 must be an int in \[1, 1073741824\]"):
        AsyncIOHandle(block_size=0)
    with pytest.raises(ValueError, match="queue_depth=True must be an int"):
        AsyncIOHandle(queue_depth=True)
    with pytest.raises(TypeError, match="use_o_direct='yes' must be True or False"):
        AsyncIOHandle(use_o_direct="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine='libaio' must be one of 'auto', 'psync', 'io_uring'"):
        AsyncIOHandle(engine="libaio")
    with pytest.raises(ValueError, match="thread_count=4 and intra_op_parallelism=2 disagree"):
        AsyncIOHandle(intra_op_parallelism=2, thread_count=4)
    assert AsyncIOHandle(thread_count=3).get_intra_op_parallelism() == 3
    handle = AsyncIOHandle()
    with pytest.raises(TypeError, match="async_pwrite: tensor must be a torch.Tensor, got list"):
        handle.async_pwrite([1, 2], tmp_path / "x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"async_pread: tensor of shape \(4, 3\) is not contiguous"):
        handle.async_pread(torch.empty(3, 4).t(), tmp_path / "x")
    with pytest.raises(ValueError, match="file_offset=-1 must be an int >= 0"):
        handle.async_pwrite(torch.empty(3), tmp_path / "x", file_offset=-1)
    with pytest.raises(TypeError, match="path must be a str or os.PathLike, got int"):
        handle.async_pwrite(torch.empty(3), 7)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layout torch.sparse_coo; the op moves dense"):
        handle.async_pwrite(torch.eye(3).to_sparse(), tmp_path / "x")
    with pytest.raises(ValueError, match="contains a NUL character"):
        handle.async_pwrite(torch.empty(3), str(tmp_path / "x\0y"))
    with pytest.raises(ValueError, match="numel=0 must be an int >= 1"):
        handle.new_cpu_locked_tensor(0, torch.empty(0))
    assert handle.wait() == 0  # nothing was queued by the refused calls
    handle.close()
    with pytest.raises(ValueError, match="the handle is closed"):
        handle.async_pwrite(torch.empty(3), tmp_path / "x")
