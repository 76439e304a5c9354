"""The aio op moves bytes exactly: write/read round trips of many sizes (block multiples or not), aligned
and unaligned tensors, offsets, many requests in flight, O_DIRECT on and off, both engines."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from _aio_helpers import ENGINES, IO_URING_OK, random_bytes, unaligned_empty

from ds_ops.aio import AsyncIOHandle

BLOCK = 64 * 1024
# Sizes around the 4 KiB O_DIRECT unit and the 64 KiB block: below, at, just past, and odd sizes.
SIZES = [1, 7, 4095, 4096, 4097, BLOCK - 1, BLOCK, BLOCK + 1, 3 * BLOCK + 4096 + 17, 1 << 20, (1 << 20) + 512]


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("use_o_direct", [True, False], ids=["direct", "buffered"])
def test_round_trip_many_sizes(tmp_path: Path, engine: str, use_o_direct: bool) -> None:
    handle = AsyncIOHandle(
        block_size=BLOCK, queue_depth=4, intra_op_parallelism=2, use_o_direct=use_o_direct, engine=engine
    )
    assert handle.engine == engine
    sources = [random_bytes(n, seed=n) for n in SIZES]
    for index, source in enumerate(sources):  # all in flight at once
        handle.async_pwrite(source, tmp_path / f"t{index}.bin")
    assert handle.wait() == len(SIZES)
    for index, n in enumerate(SIZES):
        assert os.path.getsize(tmp_path / f"t{index}.bin") == n
    aligned = [handle.new_cpu_locked_tensor(n, torch.empty(0, dtype=torch.uint8)) for n in SIZES]
    unaligned = [unaligned_empty(n) for n in SIZES]
    for index in range(len(SIZES)):
        handle.async_pread(aligned[index], tmp_path / f"t{index}.bin")
        handle.async_pread(unaligned[index], tmp_path / f"t{index}.bin")
    assert handle.wait() == 2 * len(SIZES)
    for source, a, u in zip(sources, aligned, unaligned, strict=True):
        assert torch.equal(a, source) and torch.equal(u, source), source.numel()
    total = 3 * sum(SIZES)
    assert handle.num_bytes_moved == total
    if use_o_direct:  # everything but the sub-4 KiB tails went direct (bounced when unaligned)
        assert handle.num_bytes_direct == 3 * sum(n - n % 4096 for n in SIZES)
    else:
        assert handle.num_bytes_direct == 0
    handle.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_unaligned_writes_and_dtypes(tmp_path: Path, engine: str) -> None:
    """Unaligned source memory (written through bounce buffers) and non-byte dtypes of odd numel."""
    handle = AsyncIOHandle(block_size=BLOCK, use_o_direct=True, engine=engine)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(100_003, generator=generator),
        "bf16": torch.randn(77_777, generator=generator).to(torch.bfloat16),
        "i64": torch.randint(-(2**62), 2**62, (5_001,), generator=generator),
    }
    for name, tensor in tensors.items():
        source = unaligned_empty(tensor.numel() * tensor.element_size())
        source.copy_(tensor.view(torch.uint8))
        handle.async_pwrite(source, tmp_path / f"{name}.bin")
    handle.wait()
    for name, tensor in tensors.items():
        back = torch.empty_like(tensor)
        handle.sync_pread(back, tmp_path / f"{name}.bin")
        assert torch.equal(back, tensor), name
        assert torch.equal(
            torch.from_file(str(tmp_path / f"{name}.bin"), size=tensor.numel(), dtype=tensor.dtype), tensor
        ), name


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("use_o_direct", [None, False], ids=["where_allowed", "buffered"])
def test_offsets_into_one_file(tmp_path: Path, engine: str, use_o_direct: bool | None) -> None:
    """Several tensors at aligned and unaligned offsets of one file, written concurrently, read back."""
    handle = AsyncIOHandle(block_size=BLOCK, intra_op_parallelism=3, use_o_direct=use_o_direct, engine=engine)
    path = tmp_path / "swap.bin"
    layout = [(0, 10_000), (12_288, 3 * BLOCK), (12_288 + 3 * BLOCK + 5, 4_099), (1 << 20, 70_001)]
    sources = [random_bytes(n, seed=i) for i, (_, n) in enumerate(layout)]
    for (offset, _), source in zip(layout, sources, strict=True):
        handle.async_pwrite(source, path, offset)
    handle.wait()
    assert os.path.getsize(path) == (1 << 20) + 70_001
    for (offset, n), source in zip(layout, sources, strict=True):
        back = unaligned_empty(n) if offset % 2 else torch.empty(n, dtype=torch.uint8)
        handle.sync_pread(back, path, file_offset=offset)
        assert torch.equal(back, source), offset
    expected = torch.zeros((1 << 20) + 70_001, dtype=torch.uint8)
    for (offset, n), source in zip(layout, sources, strict=True):
        expected[offset : offset + n] = source
    assert torch.equal(torch.from_file(str(path), size=expected.numel(), dtype=torch.uint8), expected)


def test_many_concurrent_requests_all_settle(tmp_path: Path) -> None:
    """64 requests over 4 files queued before one wait; wait() counts them and every byte lands."""
    handle = AsyncIOHandle(block_size=16 * 1024, queue_depth=8, intra_op_parallelism=4)
    chunk = 20_000
    sources = [random_bytes(chunk, seed=i) for i in range(64)]
    for i, source in enumerate(sources):
        handle.async_pwrite(source, tmp_path / f"f{i % 4}.bin", file_offset=(i // 4) * chunk)
    assert handle.wait() == 64
    backs = [torch.empty(chunk, dtype=torch.uint8) for _ in sources]
    for i, back in enumerate(backs):
        handle.async_pread(back, tmp_path / f"f{i % 4}.bin", file_offset=(i // 4) * chunk)
    assert handle.wait() == 64
    assert all(torch.equal(a, b) for a, b in zip(backs, sources, strict=True))
    assert handle.wait() == 0  # nothing left


@pytest.mark.parametrize("single_submit,overlap_events", [(True, False), (False, False), (True, True)])
def test_submission_modes_move_the_same_bytes(tmp_path: Path, single_submit: bool, overlap_events: bool) -> None:
    handle = AsyncIOHandle(
        block_size=BLOCK,
        queue_depth=3,
        single_submit=single_submit,
        overlap_events=overlap_events,
        intra_op_parallelism=2,
    )
    source = random_bytes(10 * BLOCK + 123, seed=7)
    handle.sync_pwrite(source, tmp_path / "x.bin")
    back = torch.empty_like(source)
    handle.sync_pread(back, tmp_path / "x.bin")
    assert torch.equal(back, source)
    assert handle.get_single_submit() is single_submit and handle.get_overlap_events() is overlap_events


def test_large_round_trip_zero_copy(tmp_path: Path) -> None:
    """64 MiB through the default handle with locked (aligned) buffers: all of it O_DIRECT."""
    handle = AsyncIOHandle(intra_op_parallelism=2)
    assert handle.engine == ("io_uring" if IO_URING_OK else "psync")
    assert handle.uses_o_direct(tmp_path / "big.bin")
    numel = 16 << 20
    source = handle.new_cpu_locked_tensor(numel, torch.empty(0))
    assert source.data_ptr() % 4096 == 0 and source.dtype == torch.float32 and source.numel() == numel
    source.copy_(torch.arange(numel, dtype=torch.float32))
    handle.sync_pwrite(source, tmp_path / "big.bin")
    back = handle.new_cpu_locked_tensor(numel, source)
    handle.sync_pread(back, tmp_path / "big.bin")
    assert torch.equal(back, source)
    assert handle.num_bytes_direct == handle.num_bytes_moved == 2 * numel * 4
    handle.free_cpu_locked_tensor(source)
    handle.free_cpu_locked_tensor(back)
    with pytest.raises(ValueError, match="not allocated by this handle"):
        handle.free_cpu_locked_tensor(back)


def test_empty_tensor_and_tmpfs(tmp_path: Path) -> None:
    """A zero-byte write creates the file; /dev/shm (tmpfs) takes O_DIRECT on recent kernels."""
    handle = AsyncIOHandle(use_o_direct=False)
    handle.sync_pwrite(torch.empty(0), tmp_path / "empty.bin")
    assert os.path.getsize(tmp_path / "empty.bin") == 0
    handle.sync_pread(torch.empty(0), tmp_path / "empty.bin")
    if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        shm = AsyncIOHandle()
        path = Path("/dev/shm") / f"ds_aio_test_{os.getpid()}.bin"
        try:
            source = random_bytes(300_001, seed=3)
            shm.sync_pwrite(source, path)
            back = torch.empty_like(source)
            shm.sync_pread(back, path)
            assert torch.equal(back, source)
        finally:
            path.unlink(missing_ok=True)
