"""`OptimizerSwapper`: the stage-3 master and optimizer state on NVMe (`offload_optimizer.device = "nvme"`).

Each tile (sub-group of at most `sub_group_size` elements, see `_stage3.partition`) has one swap file for
its master (fp32, or bf16 with `bf16_master_weights_and_grads`, as DeepSpeed pages them) and one per
partition-shaped optimizer-state tensor (Adam: `exp_avg`, `exp_avg_sq`). Between
steps the tile's master and state tensors are placeholders (right shape, one NaN element). The step visits
the tiles in order: read the tile into a buffer set, point the master and the state at the buffers, run the
base optimizer on it, write it back. The gradient partition stays in host memory.

Buffer sets (allocated once; the state buffers after the first step, when the optimizer has made its state):
one, plus one with `pipeline_read` (the next tile is read while this one steps) or `pipeline_write` (this
tile's write is in flight while the next one is read and steps) or both. Each set has one buffer for the
master and one per state tensor (`buffer_count` must be at least that), each the largest tile's size.

[Note: two buffer sets for both pipelines] With both flags the next tile's read-ahead goes into the set the
previous tile's writes are leaving. Each key's writes go through a handle of their own (`key_writer`), so
the read into a buffer waits for that buffer's write alone: the master's read-ahead starts once the master
is written while the moments are still being written, and the disk keeps reads and writes queued together
(waiting for the whole set first, then reading, was 17% slower on `benchmarks/infinity.py --layers 9`; per
buffer, within that run's noise of three sets). A third set would hold one more copy of the largest tile's
master and state for the overlap of whole sets (3 x 256 MiB at 0.6B, a sixth of that job's peak RSS). What
two sets give up is overlap when the update computes longer than the next read takes.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from ds_ops.aio import AioError
from ds_ops.precision import StepOutcome
from ds_zero._nvme.files import SwapFile, claim_finalizer, dtype_word, io_failure, make_aio_handle
from ds_zero._nvme.grad_swapper import GradSwapper
from ds_zero._params.partitioned_param import state_of
from ds_zero._stage3.partition import ShardTile
from ds_zero._stage3.partition_index import PartitionIndex

if TYPE_CHECKING:
    from ds_ops.aio import AioConfig
    from ds_zero.config import OffloadOptimizerConfig

logger = logging.getLogger(__name__)

__all__ = ["OptimizerSwapper"]

_KEY = "zero_optimization.offload_optimizer"
_MASTER = "fp32"
_GRAD = "grad"  # the set's buffer the tile's swapped gradient is read into (GradSwapper writes the files)


def _placeholder(numel: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full((1,), float("nan"), dtype=dtype).expand(numel)


class OptimizerSwapper:
    """Swaps each tile's master and optimizer state between NVMe files and reused host buffers.

    Args:
        tiles: the base optimizer's parameters (every group's tiles, in order), with `swap_master` partitions.
        optimizer: the base optimizer (its state is swapped).
        index: the stage-3 optimizer's `PartitionIndex`; each parameter's record gets the writer of its master
            slice (`master_writer`), which a write of the parameter's shard goes through.
        swap_dir: this rank's directory (`prepare_swap_dir`, checked before the partitions were built).
        config: the `offload_optimizer` section (buffer_count, pipeline_read, pipeline_write).
        aio_config: the top-level `aio` section (None: its defaults).

    Raises:
        NVMeSwapError: the initial masters could not be written (disk full, file-size limit).
    """

    def __init__(
        self,
        tiles: list[ShardTile],
        optimizer: torch.optim.Optimizer,
        *,
        index: PartitionIndex,
        swap_dir: os.PathLike[str],
        config: OffloadOptimizerConfig,
        aio_config: Mapping[str, Any] | AioConfig | None = None,
    ) -> None:
        self.dir = swap_dir
        claim_finalizer(self, self.dir)
        self.tiles = tiles
        self.optimizer = optimizer
        self.reader = make_aio_handle(aio_config)
        self._aio_config = aio_config
        self._key_writers: dict[str, Any] = {}  # `key_writer`
        self.buffer_count = config.buffer_count
        self.pipeline_read = config.pipeline_read
        self.pipeline_write = config.pipeline_write
        if config.fast_init:
            warnings.warn(
                f"{_KEY}.fast_init has no effect: the initial masters are always written at construction",
                UserWarning,
                stacklevel=3,
            )
        self.max_numel = max((t.numel for t in tiles), default=0)
        # fp32, or bf16 with `bf16_master_weights_and_grads` (DeepSpeed pages the masters in their own dtype)
        self.master_dtype = tiles[0].partition.master_dtype if tiles else torch.float32
        self.num_sets = 1 + int(self.pipeline_read or self.pipeline_write)  # the module note
        self._files: dict[tuple[int, str, int], SwapFile] = {}
        self._slot: dict[int, int] = {}  # tile index -> the file set holding its committed values (`spare_slot`)
        self.disk_limit_logged = False  # `ds_zero._nvme.eager_step.fitting_on_disk` said the disk is too small
        self._keys: dict[int, list[tuple[str, torch.dtype]]] = {}
        self._sets: list[dict[str, torch.Tensor]] = []
        example = torch.empty(0, dtype=torch.uint8)
        for _ in range(self.num_sets):
            self._sets.append(
                {_MASTER: self.reader.new_cpu_locked_tensor(self.max_numel * self.master_dtype.itemsize, example)}
            )
        for k, tile in enumerate(tiles):
            tile.index, tile.swap = k, self
            for p, off in zip(tile.params, tile.offsets, strict=True):
                index[p].master_writer = self._master_writer(tile, off)
        self._write_initial_masters()
        self.grads = GradSwapper(tiles, swap_dir=self.dir, handle=make_aio_handle(aio_config), dtype=self.master_dtype)
        self.grad_outcome: StepOutcome | None = None  # the factors finish_step left for the gradients read
        self.num_reads = 0
        self.num_writes = 0

    # ------------------------------------------------------------------------------ files and buffers
    def _file(self, tile: ShardTile, key: str, slot: int | None = None) -> SwapFile:
        """The file of the tile's `key` in `slot` (None: the committed one, see `spare_slot`)."""
        if slot is None:
            slot = self._slot.get(tile.index, 0)
        record = self._files.get((tile.index, key, slot))
        if record is None:
            name = f"{dtype_word(self.master_dtype)} master" if key == _MASTER else f"optimizer state {key!r}"
            names = [repr(state_of(p).name) for p in tile.params[:3]]
            params = ", ".join(names) + (" ..." if len(tile.params) > 3 else "")
            suffix = "" if slot == 0 else f".{slot}"
            record = SwapFile(
                self.dir / f"tile{tile.index}.{key}{suffix}.swp",
                f"the {name} of sub-group {tile.index} (parameters {params})",
            )
            self._files[(tile.index, key, slot)] = record
        return record

    def spare_slot(self, tile: ShardTile) -> int:
        """The file set that does not hold the tile's committed master and state.

        [Note: two file sets] An update made during the backward (`ds_zero._nvme.eager_step`) is speculative:
        the step may still be skipped (inf/nan) or clipped. It is written to the spare set, so the committed
        set keeps the pre-update values untouched: that is the undo copy, on disk like the state itself, at
        no extra traffic (the write goes to another file instead of the same one) and no host memory; the
        price is disk space, the optimizer state twice. `commit_slot` makes the spare set the committed one;
        an undo just leaves the committed set as it was.
        """
        return 1 - self._slot.get(tile.index, 0)

    def spare_bytes_needed(self, tile: ShardTile) -> int:
        """Disk bytes the tile's spare set (`spare_slot`) still has to claim: its master and swapped state
        files not yet written (0 once an update during backward has written them; they are then reused)."""
        spare = self.spare_slot(tile)
        keys = [(_MASTER, self.master_dtype), *self._keys.get(tile.index, [])]
        total = 0
        for key, dtype in keys:
            record = self._files.get((tile.index, key, spare))
            if record is None or not record.nbytes:
                total += tile.numel * dtype.itemsize
        return total

    def commit_slot(self, tile: ShardTile) -> None:
        """The tile's update written to the spare set stands: that set is now the committed one."""
        self._slot[tile.index] = self.spare_slot(tile)

    def key_writer(self, key: str) -> Any:
        """The handle the writes of `key`'s files go through (one per buffer of a set), so a read into a
        buffer waits for that buffer's write alone while the set's other writes stay in flight."""
        handle = self._key_writers.get(key)
        if handle is None:
            handle = self._key_writers[key] = make_aio_handle(self._aio_config)
        return handle

    def wait_key_writers(self, writes: list[tuple[SwapFile, torch.Tensor, Any]], key: str | None = None) -> None:
        """Wait for the writes in flight (`key`'s only, or all), naming `writes`' files if one failed."""
        handles = self._key_writers.values() if key is None else [self._key_writers.get(key)]
        for handle in handles:
            if handle is not None:
                self._wait(handle, "write", [r for r, _, _ in writes])

    def _view(self, set_index: int, key: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        raw = self._sets[set_index][key]
        return raw[: numel * torch.empty(0, dtype=dtype).element_size()].view(dtype)

    def _ensure_state_buffers(self, keys: list[tuple[str, torch.dtype]]) -> None:
        """Allocate the state buffers of every set, once (the first time the optimizer's state is known)."""
        need = 1 + len(keys)
        if need > self.buffer_count:
            raise ValueError(
                f"{_KEY}.buffer_count={self.buffer_count} is too small: the optimizer keeps {len(keys)} "
                f"state tensors per parameter ({[k for k, _ in keys]}), which with the master need "
                f"{need} buffers; set buffer_count >= {need}"
            )
        example = torch.empty(0, dtype=torch.uint8)
        for buffers in self._sets:
            for key, dtype in keys:
                if key not in buffers:
                    nbytes = self.max_numel * torch.empty(0, dtype=dtype).element_size()
                    buffers[key] = self.reader.new_cpu_locked_tensor(nbytes, example)

    def _write_initial_masters(self) -> None:
        for tile in self.tiles:
            if tile.numel:
                self._write_now(tile, _MASTER, tile.shard_fp32_values().to(self.master_dtype))

    def _write_now(self, tile: ShardTile, key: str, values: torch.Tensor) -> None:
        record = self._file(tile, key)
        src = values.detach().reshape(-1).contiguous()
        writer = self.key_writer(key)
        writer.async_pwrite(src, record.path)
        self._wait(writer, "write", [record])
        record.recorded(src)

    def _read_now(self, tile: ShardTile, key: str, dtype: torch.dtype) -> torch.Tensor:
        record = self._file(tile, key)
        out = torch.empty(tile.numel, dtype=dtype)
        record.check_before_read(out.numel() * out.element_size())
        self.reader.async_pread(out, record.path)
        self._wait(self.reader, "read", [record])
        record.verify(out)
        return out

    @staticmethod
    def _wait(handle: Any, op: str, files: list[SwapFile]) -> None:
        try:
            handle.wait()
        except AioError as err:
            raise io_failure(err, files, op) from err

    def _master_writer(self, tile: ShardTile, offset: int) -> Any:
        def write(values: torch.Tensor) -> None:
            master = self.read_master(tile)
            master[offset : offset + values.numel()].copy_(values)
            self._write_now(tile, _MASTER, master)

        return write

    # ------------------------------------------------------------------------------ the step
    def _state_keys(self, tile: ShardTile) -> list[tuple[str, torch.dtype]]:
        """The tile's partition-shaped state tensors now in the optimizer (what gets swapped)."""
        state = self.optimizer.state.get(tile.master, {})
        return [
            (key, v.dtype)
            for key, v in state.items()
            if torch.is_tensor(v) and key != "step" and tuple(v.shape) == (tile.numel,)
        ]

    def _issue_reads(
        self,
        tile: ShardTile,
        set_index: int,
        with_grad: bool = True,
        before_read: Callable[[str], None] | None = None,
    ) -> list[tuple[SwapFile, torch.Tensor, Any]]:
        """Read the tile's master and state (and gradient) into set `set_index`; `before_read(key)` is called
        before each buffer's read is issued (to let the write still leaving that buffer land first)."""
        reads: list[tuple[SwapFile, torch.Tensor, Any]] = []
        if tile.numel == 0:  # a param group without trainable parameters
            return reads
        keys = [(_MASTER, self.master_dtype), *self._keys.get(tile.index, [])]
        if with_grad and self.grads.has_grad(tile):
            keys.append((_GRAD, self.master_dtype))
            if _GRAD not in self._sets[set_index]:
                for buffers in self._sets:
                    buffers[_GRAD] = self.reader.new_cpu_locked_tensor(
                        self.max_numel * self.master_dtype.itemsize, torch.empty(0, dtype=torch.uint8)
                    )
        for key, dtype in keys:
            record = self.grads.file(tile) if key == _GRAD else self._file(tile, key)
            view = self._view(set_index, key, tile.numel, dtype)
            record.check_before_read(view.numel() * view.element_size())
            if before_read is not None:
                before_read(key)
            reads.append((record, view, self.reader.async_pread(view, record.path, checksum=True)))
            self.num_reads += 1
        return reads

    def _bind(
        self, tile: ShardTile, set_index: int, reads: list[tuple[SwapFile, torch.Tensor, Any]], with_grad: bool = True
    ) -> None:
        """The reads landed: check them, then point the master and the state at the buffers."""
        for record, view, request in reads:
            record.verify(view, request.result.checksum)
        if tile.numel == 0:
            return
        tile.master.data = self._view(set_index, _MASTER, tile.numel, self.master_dtype)
        if with_grad and self.grads.has_grad(tile):
            grad = self._view(set_index, _GRAD, tile.numel, self.master_dtype)
            tile.master.grad = grad if self.grad_outcome is None else self.grad_outcome.apply_(grad)
        keys = self._keys.get(tile.index)
        if keys:
            state = self.optimizer.state[tile.master]
            for key, dtype in keys:
                state[key] = self._view(set_index, key, tile.numel, dtype)

    def _issue_writes(self, tile: ShardTile, slot: int | None = None) -> list[tuple[SwapFile, torch.Tensor, Any]]:
        """Write the bound tile's master and state to `slot` (None: the committed set), each key on its own
        writer (`key_writer`)."""
        if tile.numel == 0:
            return []
        keys = self._state_keys(tile)
        if keys and any(key not in self._sets[0] for key, _ in keys):  # (also after loading a stateless checkpoint)
            self._ensure_state_buffers(keys)
        self._keys[tile.index] = keys
        state = self.optimizer.state.get(tile.master, {})
        writes = []
        for key, tensor in [(_MASTER, tile.master.data), *((k, state[k]) for k, _ in keys)]:
            record = self._file(tile, key, slot)
            src = tensor.detach()
            if not src.is_contiguous():
                src = src.contiguous()
            writes.append((record, src, self.key_writer(key).async_pwrite(src, record.path, checksum=True)))
            self.num_writes += 1
        return writes

    def _unbind(self, tile: ShardTile, writes: list[tuple[SwapFile, torch.Tensor, Any]]) -> None:
        """The writes completed: record them and drop the tile's in-memory values."""
        for record, src, request in writes:
            record.recorded(src, request.result.checksum)
        if tile.numel == 0:
            return
        tile.master.grad = None
        tile.master.data = _placeholder(tile.numel, self.master_dtype)
        state = self.optimizer.state.get(tile.master)
        if state:
            for key, dtype in self._keys.get(tile.index, []):
                state[key] = _placeholder(tile.numel, dtype)

    def swapped_in(self, tiles: list[ShardTile]) -> Iterator[ShardTile]:
        """Yield each tile with its master and state in buffers; write it back when the caller moves on.

        The caller steps the yielded tile (and writes its model-dtype shards) before asking for the next.
        """
        pending_write: tuple[ShardTile, list[tuple[SwapFile, torch.Tensor, Any]]] | None = None
        ahead: list[tuple[SwapFile, torch.Tensor, Any]] | None = None

        def land_pending(key: str | None = None) -> None:
            """The previous tile's writes (`key`'s only) have landed; once all have, it is unbound."""
            nonlocal pending_write
            if pending_write is not None:
                self.wait_key_writers(pending_write[1], key)
                if key is None:
                    self._unbind(*pending_write)
                    pending_write = None

        try:
            for i, tile in enumerate(tiles):
                set_index = i % self.num_sets
                reads = ahead if ahead is not None else self._issue_reads(tile, set_index)
                self._wait(self.reader, "read", [r for r, _, _ in reads])
                ahead = None
                if self.pipeline_read and i + 1 < len(tiles):
                    # with both pipelines the next tile's set is the one the previous tile's writes leave (the
                    # module note): each buffer's read waits for its own write
                    before = land_pending if pending_write is not None else None
                    ahead = self._issue_reads(tiles[i + 1], (i + 1) % self.num_sets, before_read=before)
                    land_pending()
                self._bind(tile, set_index, reads)
                yield tile
                writes = self._issue_writes(tile)
                land_pending()  # (pipeline_write alone: the previous tile's write overlapped this tile's step)
                pending_write = (tile, writes)
                if not self.pipeline_write:
                    land_pending()
            land_pending()
        finally:  # stopped early (an error): let requests in flight land before their memory can go
            for handle in (self.reader, *self._key_writers.values()):
                try:
                    handle.wait()
                except AioError:
                    pass

    # ------------------------------------------------------------------------------ checkpoints
    def read_master(self, tile: ShardTile) -> torch.Tensor:
        """A fresh copy of the tile's master (in `master_dtype`), read from its swap file (checked)."""
        if tile.numel == 0:
            return torch.empty(0, dtype=self.master_dtype)
        return self._read_now(tile, _MASTER, self.master_dtype)

    def write_master(self, tile: ShardTile, values: torch.Tensor) -> None:
        """Replace the tile's master with `values` (stored in `master_dtype`)."""
        if tile.numel:
            self._write_now(tile, _MASTER, values.to(self.master_dtype))

    def read_tensor(self, tile: ShardTile, key: str | None) -> torch.Tensor | None:
        """A fresh copy of the tile's master (`key` None) or of its swapped optimizer state `key`.

        None when the optimizer keeps no swapped `key` for the tile (before its first step, or a state
        that is not partition-shaped and so never leaves memory).
        """
        if key is None:
            return self.read_master(tile)
        dtype = dict(self._keys.get(tile.index, [])).get(key)
        return None if dtype is None else self._read_now(tile, key, dtype)

    def write_tensor(self, tile: ShardTile, key: str | None, values: torch.Tensor) -> None:
        """Replace the tile's master (`key` None) or swapped optimizer state `key` with `values`."""
        if key is None:
            self.write_master(tile, values)
            return
        dtype = dict(self._keys.get(tile.index, []))[key]
        if tile.numel:
            self._write_now(tile, key, values.to(dtype))

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's `state_dict()` with every swapped state tensor read back (fresh copies)."""
        sd = self.optimizer.state_dict()
        states = sd["state"]
        for tile in self.tiles:
            keys = self._keys.get(tile.index)
            if keys and tile.index in states:
                entry = dict(states[tile.index])
                for key, dtype in keys:
                    entry[key] = self._read_now(tile, key, dtype)
                states[tile.index] = entry
        return sd

    def adopt_state(self) -> None:
        """After `optimizer.load_state_dict`: write the loaded state tensors to their files, free them."""
        for tile in self.tiles:
            keys = self._state_keys(tile)
            self._keys[tile.index] = keys
            if not keys:
                continue
            self._ensure_state_buffers(keys)
            state = self.optimizer.state[tile.master]
            for key, dtype in keys:
                self._write_now(tile, key, state[key])
                state[key] = _placeholder(tile.numel, dtype)

    def release_grad_buffers(self) -> None:
        """Free the sets' gradient buffers (updates during backward use the gradient swapper's own; a later
        step that reads gradients from disk allocates them again)."""
        for buffers in self._sets:
            grad = buffers.pop(_GRAD, None)
            if grad is not None:
                self.reader.free_cpu_locked_tensor(grad)

    def close(self) -> None:
        self.grads.close()
        for buffers in self._sets:
            for t in buffers.values():
                self.reader.free_cpu_locked_tensor(t)
        self._sets = []
