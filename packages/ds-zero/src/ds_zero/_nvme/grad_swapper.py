"""`GradSwapper`: with the optimizer on NVMe, the stage-3 fp32 gradient partition lives in swap files too.

Without it the gradient partition is the one piece of optimizer-side state that scales with the model
and stays in host memory (4 bytes per parameter: 9.7 GB for 2.4B parameters), so "past the machine's
memory" ends there. Here each tile (sub-group) has a gradient swap file. During backward the reduced
gradient pieces of a tile are collected in a tile-sized buffer; once every parameter of the tile has
delivered its piece (each does once per backward, see `GradReducer`) the buffer is measured (norm term
and inf/nan, for `finish_step`) and written out, and the buffer is reused. A later micro-step of the same
accumulation window reads the file back first and adds. At the step the optimizer swapper reads each
tile's gradient next to its master and state (`OptimizerSwapper`), so host memory holds gradients only
for the tiles in flight: a few buffers, whatever the model's size.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ds_ops.aio import AioError
from ds_ops.precision import GradStats
from ds_zero._nvme.files import SwapFile, dtype_word, io_failure

if TYPE_CHECKING:
    from ds_ops.aio import AsyncIOHandle
    from ds_zero._stage3.partition import ShardTile

logger = logging.getLogger(__name__)

__all__ = ["GradSwapper"]


@dataclass
class _OpenTile:
    """A tile whose gradient is being collected in `buffer` during a backward."""

    tile: ShardTile
    base: torch.Tensor  # the whole pool buffer
    buffer: torch.Tensor  # its first tile.numel elements
    accumulate: bool  # the buffer holds the file's earlier micro-steps: pieces are added, not copied
    filled: int = 0


class GradSwapper:
    """Collects, writes and reads back the gradient (fp32, or bf16 with bf16 masters) of each swapped tile.

    Args:
        tiles: the stage-3 optimizer's tiles (their `index` already set by the optimizer swapper).
        swap_dir: the optimizer swap directory of this rank.
        handle: an async I/O handle of its own (waits on it settle only gradient writes).
        norm_type: p of the gradient norm the stats are for.
        dtype: the gradients' dtype: fp32, or the masters' bf16 with `bf16_master_weights_and_grads`.
    """

    def __init__(
        self,
        tiles: list[ShardTile],
        *,
        swap_dir: os.PathLike[str],
        handle: AsyncIOHandle,
        norm_type: float = 2.0,
        dtype: torch.dtype = torch.float32,
    ):
        self.dir = swap_dir
        self.handle = handle
        self.dtype = dtype
        self.norm_type = float(norm_type)
        self.max_numel = max((t.numel for t in tiles), default=0)
        self._files: dict[int, SwapFile] = {}
        self._valid: set[int] = set()  # tiles whose file holds this accumulation window's gradient
        self._stats: dict[int, tuple[float, bool]] = {}
        self._open: dict[int, _OpenTile] = {}
        self._free: list[torch.Tensor] = []
        # (file, written view, its buffer, the aio request)
        self._writing: list[tuple[SwapFile, torch.Tensor, torch.Tensor, Any]] = []
        self.num_buffers = 0
        self.eager: Any = None  # an `EagerSteps` while this backward may step sub-groups as they complete
        self._closing_order: list[ShardTile] = []
        self.last_order: list[ShardTile] = []  # the sub-groups in the order the last backward completed them

    # ------------------------------------------------------------------------------ files and buffers
    def file(self, tile: ShardTile) -> SwapFile:
        record = self._files.get(tile.index)
        if record is None:
            label = f"the {dtype_word(self.dtype)} gradient of sub-group {tile.index}"
            record = SwapFile(self.dir / f"tile{tile.index}.grad.swp", label)
            self._files[tile.index] = record
        return record

    def has_grad(self, tile: ShardTile) -> bool:
        """Whether the tile got a gradient since the last `zero_grad` (written to its file)."""
        return tile.index in self._valid

    def _buffer(self) -> torch.Tensor:
        if not self._free and self._writing:
            self._settle_writes()
        if self._free:
            return self._free.pop()
        self.num_buffers += 1
        if self.num_buffers > 4:
            logger.debug("NVMe gradient swap: %d tile buffers in use", self.num_buffers)
        return self.handle.new_cpu_locked_tensor(max(1, self.max_numel), torch.empty(0, dtype=self.dtype))

    def _settle_writes(self) -> None:
        writing, self._writing = self._writing, []
        if not writing:
            return
        try:
            self.handle.wait()
        except AioError as err:
            raise io_failure(err, [record for record, _, _, _ in writing], "write") from err
        for record, src, base, request in writing:
            record.recorded(src, request.result.checksum)
            self._free.append(base)

    def _read_file(self, tile: ShardTile, into: torch.Tensor) -> None:
        """Read the tile's gradient file into `into` (its numel elements), after any pending writes; checked."""
        record = self.file(tile)
        record.check_before_read(tile.numel * self.dtype.itemsize)
        self._settle_writes()
        try:
            request = self.handle.async_pread(into, record.path, checksum=True)
            self.handle.wait()
        except AioError as err:
            raise io_failure(err, [record], "read") from err
        record.verify(into, request.result.checksum)

    def _measure(self, tile: ShardTile, grad: torch.Tensor) -> None:
        """Record the tile's gradient norm term and inf/nan flag (what `stats` sums for `finish_step`)."""
        p = self.norm_type
        norm = float(torch.linalg.vector_norm(grad, p, dtype=torch.float32))  # a bf16 gradient's norm in fp32
        self._stats[tile.index] = (norm if math.isinf(p) else norm**p, not math.isfinite(norm))

    # ------------------------------------------------------------------------------ backward
    def add(self, tile: ShardTile, offset: int, piece: torch.Tensor) -> None:
        """Add (or, first in the window, copy) a reduced gradient piece at `offset` of the tile's gradient."""
        entry = self._open.get(tile.index)
        if entry is None:
            if self.eager is not None and tile.index in self.eager.stepped:
                raise RuntimeError(
                    f"NVMe offload: sub-group {tile.index} was already updated during this backward (its gradient "
                    "looked complete) when another gradient piece for it arrived; this happens when a parameter's "
                    "gradient is produced twice in one backward (reentrant activation checkpointing)"
                )
            entry = self._start(tile)
        view = entry.buffer[offset : offset + piece.numel()]
        if entry.accumulate:
            view.add_(piece)
        else:
            view.copy_(piece)
        entry.filled += piece.numel()
        if entry.filled >= tile.numel:
            self._close(entry)

    def _start(self, tile: ShardTile) -> _OpenTile:
        base = self._buffer()
        buffer = base[: tile.numel]
        accumulate = tile.index in self._valid
        if accumulate:  # an earlier micro-step of this window: start from what it wrote
            self._read_file(tile, buffer)
        entry = _OpenTile(tile, base, buffer, accumulate)
        self._open[tile.index] = entry
        return entry

    def _close(self, entry: _OpenTile) -> None:
        del self._open[entry.tile.index]
        buffer = entry.buffer
        self._measure(entry.tile, buffer)
        self._closing_order.append(entry.tile)
        eager = self.eager
        # With `keep_grads` (clipping: a clipped step redoes the updates from the gradients on disk) the write
        # starts first and overlaps the update, which reads the buffer and leaves it as it is.
        keep = eager is None or eager.keep_grads
        if keep:
            self._write(entry)
        if eager is not None and eager.offer(entry.tile, buffer):
            if not keep:
                self._free.append(entry.base)  # the step consumed the gradient: nothing to write
            return
        if not keep:
            self._write(entry)

    def _write(self, entry: _OpenTile) -> None:
        record = self.file(entry.tile)
        request = self.handle.async_pwrite(entry.buffer, record.path, checksum=True)
        self._writing.append((record, entry.buffer, entry.base, request))
        self._valid.add(entry.tile.index)

    def flush(self) -> None:
        """End of backward: write every tile still open (a late, partial addition) and settle the writes."""
        for entry in list(self._open.values()):
            if not entry.accumulate and entry.filled < entry.tile.numel:
                raise RuntimeError(
                    f"NVMe gradient swap: sub-group {entry.tile.index} got {entry.filled} of its "
                    f"{entry.tile.numel} gradient elements in a backward; every parameter delivers its piece once"
                )
            self._close(entry)
        self._settle_writes()
        if self.eager is not None:
            self.eager.finish()
        if self._closing_order:
            self.last_order, self._closing_order = self._closing_order, []

    # ------------------------------------------------------------------------------ between backward and step
    def _check_settled(self, tile: ShardTile, op: str) -> None:
        if tile.index in self._open:
            raise RuntimeError(
                f"NVMe gradient swap: cannot {op} the gradient of sub-group {tile.index} while a backward is "
                "still delivering it; read or set gradients after backward returns"
            )
        if self.eager is not None and tile.index in self.eager.stepped and (op != "read" or not self.has_grad(tile)):
            raise RuntimeError(
                f"NVMe gradient swap: sub-group {tile.index} was already updated during backward (eager sub-group "
                f"steps); its gradient was consumed and cannot be {op}"
            )

    def read(self, tile: ShardTile) -> torch.Tensor | None:
        """A fresh copy of the tile's gradient of this accumulation window; None before any backward."""
        self._check_settled(tile, "read")
        if tile.index not in self._valid:
            return None
        out = torch.empty(tile.numel, dtype=self.dtype)
        self._read_file(tile, out)
        return out

    def write(self, tile: ShardTile, values: torch.Tensor) -> None:
        """Replace the tile's gradient with `values` (stored in `dtype`); its norm term and inf/nan flag are
        measured anew.

        A tile updated during the backward from its old gradient is undone first; `step()` updates it."""
        eager = self.eager
        if eager is not None and not eager.settled and tile.index in eager.stepped:
            eager.undo([tile.index], "its gradient was replaced before step()")
        self._check_settled(tile, "written")
        self._settle_writes()
        src = values.detach().to(self.dtype).reshape(-1).contiguous()
        self._measure(tile, src)
        record = self.file(tile)
        try:
            request = self.handle.async_pwrite(src, record.path, checksum=True)
            self.handle.wait()
        except AioError as err:
            raise io_failure(err, [record], "write") from err
        record.recorded(src, request.result.checksum)
        self._valid.add(tile.index)

    # ------------------------------------------------------------------------------ the step
    def stats(self, tiles: Iterable[ShardTile] | None = None) -> GradStats:
        """The norm term and inf/nan flag of every written gradient (for `finish_step`), or of `tiles`' only."""
        wanted = None if tiles is None else {t.index for t in tiles}
        measured = [v for i, v in self._stats.items() if wanted is None or i in wanted]
        terms = [t for t, _ in measured]
        p = self.norm_type
        term = (max(terms) if math.isinf(p) else sum(terms)) if terms else 0.0
        return GradStats(norm_term=term, nonfinite=any(bad for _, bad in measured))

    def zero_grad(self) -> None:
        """Forget the gradients: the next backward starts the files afresh (nothing is read back)."""
        self._settle_writes()
        for entry in self._open.values():
            self._free.append(entry.base)
        self._open.clear()
        self._valid.clear()
        self._stats.clear()
        self._closing_order = []
        if self.eager is not None:  # updates made from gradients no step will use
            self.eager.undo_all()
        self.eager = None

    def close(self) -> None:
        try:
            self._settle_writes()
        except Exception:  # closing after a failure: the error was raised where it happened
            logger.debug("NVMe gradient swap: pending writes failed while closing", exc_info=True)
        for buffer in self._free:
            self.handle.free_cpu_locked_tensor(buffer)
        self._free = []
