"""`DecoupledWriter`: checkpoint files written by a background worker (`checkpoint.writer.decoupled: true`).

DeepSpeed's decoupled engine hands each file's state to a writer process and lets training go on; its
engine commits (waits for the writes, then writes `latest`) at the next optimizer step. ds keeps the
published-checkpoint rule of the synchronous path while doing the same:

* The save snapshots each file's state (`_checkpoint.snapshot`: a deep copy that keeps tensors that share
  storage shared, so the file is byte-for-byte what a synchronous save writes, into memory kept from the
  previous save) and queues it; a worker thread writes it
  through the engine's writer (`CheckpointFileWriter.save`: temporary name, fsync, rename). The snapshot
  is what lets the optimizer step run while the files are written (DeepSpeed's step waits for the
  writer instead): its cost is one copy of the saved state, made on the state's device.
* `latest` moves only at a commit, after every rank's files of the tag are durable: at the first optimizer
  step boundary where a small all-reduce finds every rank's queue empty (the step never waits), at the
  next save or load, at `commit()`, or at `engine.destroy()` (these wait).
* A failed background write leaves the old file under its name (the atomic publish), keeps `latest`
  where it was, and is raised at the next save / commit, naming the file on the rank that failed it and
  that rank on the others.
* A process that ends with writes queued finishes them at exit (an exit hook drains the queue; with the
  process group still up it commits, else `latest` stays and the log says so).

[Note: why a thread] DeepSpeed uses a spawned process; the state would have to be copied into shared
memory for it. The snapshot is already in this process, and the heavy parts of a write (tensor copies,
file and async I/O calls) release the GIL.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.util
import os
import queue
import threading
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import ds_comm
from ds_comm import atomic_write_text
from ds_engine._checkpoint.snapshot import SnapshotPool
from ds_engine._plan.dist_info import DistInfo

logger = logging.getLogger(__name__)

__all__ = ["DecoupledCheckpointError", "DecoupledWriter", "PendingCheckpoint", "QueuedFiles", "file_saver"]

SaveFn = Callable[..., None]
"""`save(obj, path, *, serialization)`: writes one file atomically (the engine's `CheckpointFileWriter.save`)."""


class DecoupledCheckpointError(RuntimeError):
    """A background checkpoint write failed; `latest` still names the last complete checkpoint."""


@dataclasses.dataclass(frozen=True)
class PendingCheckpoint:
    """A saved checkpoint whose files may still be in flight: what its commit publishes."""

    save_dir: Path
    tag: str
    save_latest: bool
    finish: Callable[[], Any] | None = None
    """Publishes the checkpoint once its files are written (collective; a DeepSpeed-layout save builds and
    renames its tag directory); None: rank 0 writes `latest` when `save_latest`."""


@dataclasses.dataclass
class _Job:
    state: Any
    path: Path
    serialization: bool
    storages: list[torch.UntypedStorage]


class DecoupledWriter:
    """One rank's background checkpoint writer and the commit of its saves (see the module docstring).

    Args:
        save: writes one file atomically (the writer the synchronous path uses).
        dist: the process layout (`commit` is a collective over the world).
        device: where the commit's small tensors live (the backend's device).
    """

    def __init__(self, save: SaveFn, dist: DistInfo, device: torch.device) -> None:
        self._save = save
        self._dist = dist
        self._device = device
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._idle = threading.Condition()
        self._outstanding = 0
        self._failures: list[tuple[Path, BaseException]] = []
        self._deferred: DecoupledCheckpointError | None = None
        self._thread: threading.Thread | None = None
        self._pool = SnapshotPool()
        self.pending: PendingCheckpoint | None = None

    # -- the writes ---------------------------------------------------------------------------------------
    def replica_writes(self, *, zero_stage: int, has_moe: bool) -> bool:
        """Never: a REPLICA write is a collective, which a background write cannot be (refused in config)."""
        return False

    def save(self, obj: Any, path: str | os.PathLike[str], *, serialization: bool = True) -> None:
        """Snapshot `obj` and queue its write to `path`; returns before the file is written."""
        try:
            state, storages = self._pool.snapshot(obj)
        except Exception as err:  # noqa: BLE001 - an object that cannot be copied is written now instead
            logger.warning(
                "checkpoint.writer.decoupled: %s cannot be snapshot (%s); writing it synchronously", path, err
            )
            self.drain()  # the writer (its staging buffer) is the worker's until then
            self._save(obj, path, serialization=serialization)
            return
        self._start()
        with self._idle:
            self._outstanding += 1
        self._queue.put(_Job(state, Path(path), serialization, storages))

    def drain(self) -> None:
        """Wait until this rank's queued files are written (local; failures stay recorded for the commit)."""
        with self._idle:
            self._idle.wait_for(lambda: self._outstanding == 0)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="ds-checkpoint-writer", daemon=True)
            self._thread.start()
            # At exit: `atexit` in a main process, and in a multiprocessing child too (which leaves by
            # os._exit, skipping atexit, but runs multiprocessing's finalizers first).
            multiprocessing.util.Finalize(None, _finish_at_exit, args=(weakref.ref(self),), exitpriority=10)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._save(job.state, job.path, serialization=job.serialization)
            except BaseException as err:  # noqa: BLE001 - recorded, raised at the commit on the training thread
                logger.error("checkpoint.writer.decoupled: writing %s failed: %s", job.path, err)
                with self._idle:
                    self._failures.append((job.path, err))
            finally:
                job.state = None
                self._pool.give_back(job.storages)
                del job
                with self._idle:
                    self._outstanding -= 1
                    self._idle.notify_all()

    # -- the commit -----------------------------------------------------------------------------------------
    def begin(self, pending: PendingCheckpoint) -> None:
        """The files of `pending` are queued (on every rank); its commit is due."""
        self.pending = pending
        self._pool.trim()

    def poll(self) -> None:
        """At an optimizer step boundary: commit the pending checkpoint if every rank has written its files.

        Collective while a checkpoint is pending (one all-reduce); never waits for the writes."""
        if self.pending is None:
            return
        with self._idle:
            busy = self._outstanding
        flags = torch.tensor([1 if busy else 0], dtype=torch.int64, device=self._device)
        self._all_reduce_max(flags)
        if int(flags.item()):
            return
        try:
            self._publish()
        except DecoupledCheckpointError as err:
            self._deferred = err  # raised at the next save or commit

    def commit(self) -> bool:
        """Wait for the pending checkpoint's files on every rank, then move `latest` (collective).

        Returns:
            True when a checkpoint was committed.

        Raises:
            DecoupledCheckpointError: a background write failed (this one's or one found at a step).
        """
        deferred, self._deferred = self._deferred, None
        if deferred is not None:
            raise deferred
        if self.pending is None:
            return False
        self.drain()
        self._publish()
        return True

    def flush(self, tag: str | None = None) -> None:
        """Wait for every rank's queued files and raise a failure among them (collective; `latest` untouched).

        `tag` names the checkpoint in the error (default: the pending one's)."""
        self.drain()
        self._raise_failures(tag or (self.pending.tag if self.pending is not None else None), publishing=False)

    def _publish(self) -> None:
        pending = self.pending
        assert pending is not None
        self.pending = None
        self._raise_failures(pending.tag, publishing=True)
        if pending.finish is not None:
            pending.finish()
            return
        if pending.save_latest and self._dist.global_rank == 0:
            atomic_write_text(pending.save_dir / "latest", pending.tag)
        _barrier()
        logger.info("committed checkpoint %s", pending.save_dir / pending.tag)

    def _raise_failures(self, tag: str | None, *, publishing: bool) -> None:
        """Every rank learns which ranks failed (a world all-reduce of one flag per rank); all raise."""
        with self._idle:
            failures, self._failures = self._failures, []
        world = self._world_size()
        failed = torch.zeros(world, dtype=torch.int64, device=self._device)
        failed[ds_comm.get_rank() if world > 1 else 0] = 1 if failures else 0
        self._all_reduce_max(failed)
        ranks = [r for r, f in enumerate(failed.tolist()) if f]
        if not ranks:
            return
        what = f"checkpoint {tag!r}" if tag is not None else "a checkpoint"
        outcome = "`latest` was not moved" if publishing else "the file under that name was left as it was"
        if failures:
            path, err = failures[0]
            raise DecoupledCheckpointError(
                f"checkpoint.writer.decoupled: writing {path} of {what} failed ({type(err).__name__}: {err}); {outcome}"
            ) from err
        raise DecoupledCheckpointError(
            f"checkpoint.writer.decoupled: rank(s) {ranks} failed writing files of {what} (see their error); {outcome}"
        )

    def _world_size(self) -> int:
        return ds_comm.get_world_size() if ds_comm.is_initialized() else 1

    def _all_reduce_max(self, values: torch.Tensor) -> None:
        if self._world_size() > 1:
            ds_comm.all_reduce(values, op=ds_comm.ReduceOp.MAX)

    # -- the end ----------------------------------------------------------------------------------------------
    def close(self) -> None:
        """Commit what is pending (collective), then stop the worker. Raises as `commit` does."""
        try:
            self.commit()
        finally:
            self._stop()

    def finish_at_exit(self) -> None:
        """The process is ending: finish the queued writes; commit when the ranks can still agree on it."""
        self.drain()
        if self.pending is not None or self._deferred is not None:
            if ds_comm.is_initialized() or self._dist.world_size == 1:
                try:
                    self.commit()
                except DecoupledCheckpointError as err:
                    logger.error("%s", err)
            else:
                logger.warning(
                    "checkpoint.writer.decoupled: the process ends after saving %s; its files on this rank are "
                    "written, but the process group is gone, so `latest` was not moved",
                    self.pending.save_dir / self.pending.tag if self.pending is not None else "a checkpoint",
                )
        self._stop()

    def _stop(self) -> None:
        if self._thread is not None:
            thread, self._thread = self._thread, None
            self._queue.put(None)
            thread.join()


def _finish_at_exit(ref: weakref.ReferenceType[DecoupledWriter]) -> None:
    writer = ref()
    if writer is not None and writer._thread is not None:
        writer.finish_at_exit()


def _barrier() -> None:
    if ds_comm.is_initialized() and ds_comm.get_world_size() > 1:
        ds_comm.barrier()


class QueuedFiles:
    """A `checkpoint_engine` for the files a save writes besides its own (a pipeline's per-layer files, through
    `PipelineModule.save_state_dict`): each `save` is queued on the decoupled writer, which publishes it
    atomically (`publishes_atomically`: the caller adds no temporary name of its own)."""

    publishes_atomically = True

    def __init__(self, writer: DecoupledWriter, *, serialization: bool) -> None:
        self.writer, self.serialization = writer, serialization

    def save(self, state_dict: Any, path: str | os.PathLike[str]) -> None:
        self.writer.save(state_dict, path, serialization=self.serialization)


def file_saver(writer: DecoupledWriter | None, *, serialization: bool) -> Callable[[Any, Path], None]:
    """How a save writes a file besides its own (an MoE expert file): queued on `writer` under
    `checkpoint.writer.decoupled` (DeepSpeed's decoupled engine queues these too), else atomically now."""
    if writer is not None:
        return QueuedFiles(writer, serialization=serialization).save
    return lambda obj, path: ds_comm.atomic_save(obj, path, serialization=serialization)
