"""The async_io op builder (registered, DS_BUILD_AIO, honest `is_compatible`, ds_report row and notes),
the engines and their fallback, and the `aio` config section (DeepSpeed's keys and defaults)."""

from __future__ import annotations

import logging
import textwrap
from pathlib import Path

import pytest
import torch
from _aio_helpers import IO_URING_OK, IO_URING_WHY_NOT, random_bytes
from _toy_ops import run_python, subprocess_env

from ds_comm import ConfigDeprecationWarning, ConfigError
from ds_ops import ALL_OPS, AioConfig, AsyncIOBuilder, AsyncIOHandle, aio_handle
from ds_ops.aio import AioError
from ds_ops.op_builder import env_var, selected_ops
from ds_ops.report import render


def test_registered_with_deepspeeds_names() -> None:
    assert ALL_OPS["async_io"] is AsyncIOBuilder
    assert env_var("async_io") == "DS_BUILD_AIO"
    assert selected_ops({"DS_BUILD_AIO": "1"}, ALL_OPS) == {"async_io": True}
    assert "async_io" in selected_ops({"DS_BUILD_OPS": "1"}, ALL_OPS)
    assert issubclass(aio_handle, AsyncIOHandle)  # DeepSpeed's face of ds's handle (ds_ops.aio._deepspeed_handle)


def test_is_compatible_says_what_it_uses_and_what_is_missing(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="ds_ops.op_builder._base"):
        compatibility = AsyncIOBuilder().is_compatible(verbose=True)
    assert compatibility, compatibility.reasons
    engine = compatibility.notes[0]
    if IO_URING_OK:
        assert engine.startswith("engine io_uring through raw syscalls (kernel ")
    else:
        assert engine.startswith("engine psync (pread/pwrite thread pool; slower): io_uring_setup failed with ")
    if not Path("/usr/include/liburing.h").exists():
        assert "liburing not installed (Debian: liburing-dev)" in str(compatibility)
    assert any("op async_io: engine" in r.getMessage() for r in caplog.records)
    assert (AsyncIOBuilder().load().ds_aio_probe_io_uring() == 0) == IO_URING_OK  # the op agrees with the probe


def test_report_lists_async_io_with_its_notes() -> None:
    text = render()
    row = next(line for line in text.splitlines() if line.startswith("async_io "))
    assert row.split()[3] == "[OKAY]"  # installed and cached depend on the run; compatible does not
    assert "op notes:" in text and "  async_io: engine " in text


# A child process that blocks io_uring with seccomp filters (EPERM, as Docker's default profile does),
# first io_uring_enter only, then also io_uring_setup, and prints what the op does in each case.
_SECCOMP_CHILD = textwrap.dedent("""
    import ctypes, struct, sys
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(38, 1, 0, 0, 0) == 0  # PR_SET_NO_NEW_PRIVS

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    def block(syscall_number):
        # BPF: load the syscall number; `syscall_number` -> ERRNO(EPERM), anything else -> ALLOW.
        prog = b"".join(struct.pack("HBBI", *ins) for ins in [
            (0x20, 0, 0, 0), (0x15, 0, 1, syscall_number), (0x06, 0, 0, 0x00050000 | 1), (0x06, 0, 0, 0x7fff0000)])
        buf = ctypes.create_string_buffer(prog)
        fprog = Fprog(4, ctypes.addressof(buf))
        assert libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) == 0, ctypes.get_errno()  # SECCOMP_MODE_FILTER

    import torch
    from ds_ops.aio import AioError, AsyncIOBuilder, AsyncIOHandle

    def round_trip(handle):
        data = torch.arange(300_000, dtype=torch.float32)
        handle.sync_pwrite(data, sys.argv[1])
        back = torch.empty_like(data)
        handle.sync_pread(back, sys.argv[1])
        return torch.equal(back, data)

    block(426)  # io_uring_enter: rings set up fine, but nothing can be submitted
    for single_submit in (False, True):
        handle = AsyncIOHandle(block_size=65536, queue_depth=4, single_submit=single_submit, engine="io_uring")
        print("ENTER", handle.engine, "EQUAL", round_trip(handle), handle.num_bytes_moved)
    block(425)  # io_uring_setup too
    print("NOTE", AsyncIOBuilder().is_compatible().notes[0])
    handle = AsyncIOHandle()
    print("SETUP", handle.engine, "EQUAL", round_trip(handle))
    try:
        AsyncIOHandle(engine="io_uring")
    except AioError as err:
        print("FORCED", err)
""")


def test_seccomp_blocked_io_uring_falls_back_to_psync(tmp_path: Path) -> None:
    """io_uring_enter refused mid-flight: queued blocks are taken back and moved with pread/pwrite,
    and the worker carries on without its ring; no byte is lost. io_uring_setup refused:
    is_compatible says so, "auto" runs psync and moves the bytes, "io_uring" is a clear error."""
    if not IO_URING_OK:
        pytest.skip(f"io_uring is already unavailable here ({IO_URING_WHY_NOT}); every other test runs psync")
    assert AsyncIOHandle().engine == "io_uring" and AsyncIOHandle(engine="psync").engine == "psync"
    out = run_python(_SECCOMP_CHILD, subprocess_env(), args=(str(tmp_path / "x.bin"),)).stdout
    assert out.count("ENTER io_uring EQUAL True 2400000") == 2, out
    assert "NOTE engine psync (pread/pwrite thread pool; slower): io_uring_setup failed with EPERM" in out, out
    assert "seccomp" in out and "SETUP psync EQUAL True" in out, out
    assert "FORCED AsyncIOHandle(engine='io_uring'): io_uring_setup failed" in out, out
    assert "use engine='auto' to fall back to psync" in out, out


def test_config_defaults_and_keys() -> None:
    config = AioConfig()
    assert config.model_dump() == {
        "block_size": 1048576,
        "queue_depth": 8,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": True,
        "use_gds": False,
    }
    with pytest.warns(ConfigDeprecationWarning, match="'thread_count' is deprecated; use 'intra_op_parallelism'"):
        assert AioConfig.model_validate({"thread_count": 4}).intra_op_parallelism == 4
    handle = AsyncIOHandle.from_config(
        {
            "block_size": 262144,
            "queue_depth": 16,
            "intra_op_parallelism": 2,
            "single_submit": True,
            "overlap_events": False,
        }
    )
    assert (
        handle.get_block_size(),
        handle.get_queue_depth(),
        handle.get_intra_op_parallelism(),
        handle.get_single_submit(),
        handle.get_overlap_events(),
    ) == (262144, 16, 2, True, False)
    assert AsyncIOHandle.from_config(AioConfig(use_gds=False)).get_block_size() == 1048576


def test_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"aio.use_gds.*'use_gds'=True is not supported by ds \(GPUDirect"):
        AsyncIOHandle.from_config({"use_gds": True})
    with pytest.raises(ConfigError, match=r"aio.block_size: Input should be greater than 0 \(got 0\)"):
        AsyncIOHandle.from_config({"block_size": 0})
    with pytest.raises(ConfigError, match=r"aio.queue_dept.*did you mean 'queue_depth'"):
        AsyncIOHandle.from_config({"queue_dept": 4})


def test_forced_io_uring_moves_bytes(tmp_path: Path) -> None:
    if not IO_URING_OK:
        with pytest.raises(AioError, match="io_uring_setup failed"):
            AsyncIOHandle(engine="io_uring")
        return
    handle = AsyncIOHandle(engine="io_uring", queue_depth=2, block_size=8192)
    source = random_bytes(100_000, seed=4)
    handle.sync_pwrite(source, tmp_path / "x.bin")
    back = torch.empty_like(source)
    handle.sync_pread(back, tmp_path / "x.bin")
    assert torch.equal(back, source)
