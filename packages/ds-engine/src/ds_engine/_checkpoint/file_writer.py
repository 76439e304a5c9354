"""`CheckpointFileWriter`: how checkpoint files reach the disk under `checkpoint.writer` (DeepSpeed's FastPersist).

Without the section every file is `torch.save`d to a temporary name and published atomically
(`ds_comm.atomic_save`). With it, the temporary file is written through a `ds_ops.fast_io` writer instead:
FAST stages torch's byte stream in aligned single or double buffers and writes them with the async I/O op
(configured by the `aio` section); PYTHON writes through a plain Python file. The publish is the same
(fsync, rename, fsync of the directory), so a failed save never replaces the last good file.

[Note: REPLICA parallel writes] With `data_parallel: "replica"`, the model-states file, which every
data-parallel rank holds the same content of, is written by all of them at once: data-parallel rank 0
creates the temporary file and sends its name to the group; each rank serializes the same state and
writes its own stripes of the stream (`FastFileWriter`'s parallel writers); the group then compares
what each saw (stream length and a digest of its end, which in torch's zip format holds the CRC-32 of
every record) and rank 0 publishes only if every rank wrote without error and all saw the same bytes.
Otherwise the temporary file is removed on rank 0 and every rank raises.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import ds_comm
from ds_comm import atomic_save, atomic_write
from ds_engine._plan.dist_info import DistInfo
from ds_ops.aio import AsyncIOHandle
from ds_ops.fast_io import BaseFileWriter, FastFileWriter, FastFileWriterConfig, PyFileWriter

if TYPE_CHECKING:
    from ds_engine.config import CheckpointWriterConfig

logger = logging.getLogger(__name__)

__all__ = ["CheckpointFileWriter", "ReplicaWriteError"]

_NAME_BYTES = 4096  # room for the temporary file's path in the broadcast


class ReplicaWriteError(ds_comm.UsageError):
    """A REPLICA parallel write did not produce a file every rank agrees on; nothing was published."""


class CheckpointFileWriter:
    """Writes one rank's checkpoint files, atomically, the way `checkpoint.writer` says.

    Args:
        settings: the `checkpoint.writer` section, or None for plain `torch.save`.
        aio: the `aio` section (an `AioConfig` or its dict): the async I/O settings of the FAST writer.
        dist: the process layout (the data-parallel group writes REPLICA files together).
        device: where the group's agreement tensors live (the backend's device).
    """

    def __init__(self, settings: CheckpointWriterConfig | None, aio: Any, dist: DistInfo, device: torch.device) -> None:
        self.settings = settings
        self._aio = aio
        self._dist = dist
        self._device = device
        self._handle: AsyncIOHandle | None = None
        self._buffer: torch.Tensor | None = None

    # -- decisions --------------------------------------------------------------------------------------
    def replica_writes(self, *, zero_stage: int, has_moe: bool) -> bool:
        """Whether the model-states file is written by every data-parallel rank (REPLICA) for this engine.

        Not under ZeRO-3 (the model-states content differs per rank, as DeepSpeed also decides) nor with MoE
        layers (expert files follow their own ranks), nor with a single data-parallel rank."""
        s = self.settings
        return (
            s is not None
            and s.data_parallel == "REPLICA"
            and self._dist.dp_world_size > 1
            and zero_stage < 3
            and not has_moe
        )

    # -- saves --------------------------------------------------------------------------------------------
    def save(self, obj: Any, path: str | os.PathLike[str], *, serialization: bool = True) -> None:
        """Write `obj` to `path` atomically: all of the new file or the old one."""
        if self.settings is None:
            atomic_save(obj, path, serialization=serialization)
            return

        def write(tmp: Path) -> None:
            self._write(obj, tmp, serialization, writers=1, rank=0)

        atomic_write(path, write)

    def save_replicated(self, obj: Any, path: str | os.PathLike[str], *, serialization: bool = True) -> None:
        """Collective over the data-parallel group: every rank passes the same `obj`; see the module note.

        Raises:
            ReplicaWriteError: a rank failed to write, or the ranks serialized different bytes (e.g. a
                `client_state` that differs across data-parallel ranks); `path` is left as it was.
        """
        dist = self._dist
        if dist.dp_rank != 0:
            tmp = self._receive_name()
            if tmp is None:
                raise ReplicaWriteError(f"checkpoint.writer: data-parallel rank 0 could not create a file for {path}")
            self._agree(self._try_write(obj, tmp, serialization), path)
            return
        sent = False

        def write(tmp: Path) -> None:
            nonlocal sent
            self._send_name(str(tmp))
            sent = True
            self._agree(self._try_write(obj, tmp, serialization), path)

        try:
            atomic_write(path, write)
        except BaseException:
            if not sent:
                self._send_name("")
            raise

    def close(self) -> None:
        """Stop the async I/O workers and drop the staging buffer."""
        if self._handle is not None:
            handle, self._handle, self._buffer = self._handle, None, None
            handle.close()

    # -- pieces -------------------------------------------------------------------------------------------
    def _try_write(self, obj: Any, tmp: Path, serialization: bool) -> tuple[BaseException | None, int, str]:
        dist = self._dist
        try:
            writer = self._write(obj, tmp, serialization, writers=dist.dp_world_size, rank=dist.dp_rank)
        except Exception as err:  # noqa: BLE001 - reported to the group, then raised on this rank
            return err, -1, ""
        assert isinstance(writer, FastFileWriter)
        return None, writer.stream_num_bytes, writer.stream_tail_digest()

    def _agree(self, outcome: tuple[BaseException | None, int, str], path: str | os.PathLike[str]) -> None:
        error, num_bytes, digest = outcome
        mine = [0 if error else 1, num_bytes, int(digest[:15] or "0", 16)]
        values = torch.tensor([*mine, *(-v for v in mine[1:])], dtype=torch.int64, device=self._device)
        ds_comm.all_reduce(values, op=ds_comm.ReduceOp.MIN, group=self._dist.dp_group)
        all_ok, lo_n, lo_d, hi_n, hi_d = (int(v) for v in values.tolist())
        if error is not None:
            raise error
        if not all_ok:
            raise ReplicaWriteError(f"checkpoint.writer: another data-parallel rank failed writing {path}")
        if (lo_n, lo_d) != (-hi_n, -hi_d):
            raise ReplicaWriteError(
                f"checkpoint.writer.data_parallel=REPLICA: the data-parallel ranks serialized different bytes "
                f"for {path} (does client_state differ across ranks?); nothing was published"
            )

    def _send_name(self, name: str) -> None:
        payload = name.encode()
        if len(payload) >= _NAME_BYTES:
            raise ValueError(f"checkpoint.writer: temporary path {name!r} is longer than {_NAME_BYTES - 1} bytes")
        buffer = torch.zeros(_NAME_BYTES, dtype=torch.uint8)
        buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self._broadcast(buffer)

    def _receive_name(self) -> Path | None:
        buffer = self._broadcast(torch.zeros(_NAME_BYTES, dtype=torch.uint8))
        name = bytes(buffer.tolist()).rstrip(b"\0").decode()
        return Path(name) if name else None

    def _broadcast(self, buffer: torch.Tensor) -> torch.Tensor:
        on_device = buffer.to(self._device)
        ds_comm.broadcast(on_device, src=self._dist.dp_src_rank, group=self._dist.dp_group)
        return on_device.cpu()

    def _write(self, obj: Any, tmp: Path, serialization: bool, *, writers: int, rank: int) -> BaseFileWriter:
        assert self.settings is not None
        writer: BaseFileWriter
        if self.settings.type == "PYTHON":
            writer = PyFileWriter(tmp)
        else:
            handle, buffer = self._staging()
            config = FastFileWriterConfig(
                dnvme_handle=handle,
                pinned_tensor=buffer,
                double_buffer=self.settings.io_buffer_double,
                num_parallel_writers=writers,
                writer_rank=rank,
                global_rank=self._dist.global_rank,
            )
            writer = FastFileWriter(tmp, config)
        try:
            torch.save(obj, writer, _use_new_zipfile_serialization=serialization)  # type: ignore[arg-type]
        except Exception:
            failure = getattr(writer, "failure", None)
            if failure is not None:
                raise failure from None  # the device's error, not torch's complaint about the stream that followed
            raise
        finally:
            writer.close()
        if self.settings.show_statistics:
            logger.info("checkpoint writer statistics: %s", writer.stats())
        return writer

    def _staging(self) -> tuple[AsyncIOHandle, torch.Tensor]:
        """The async I/O handle and its staging buffer, made at the first FAST save and kept."""
        if self._handle is None:
            assert self.settings is not None
            self._handle = AsyncIOHandle.from_config(self._aio)
            self._buffer = self._handle.new_cpu_locked_tensor(
                self.settings.io_buffer_size, torch.empty(0, dtype=torch.uint8)
            )
        assert self._buffer is not None
        return self._handle, self._buffer
