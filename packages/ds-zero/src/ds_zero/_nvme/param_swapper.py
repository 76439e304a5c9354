"""`ParamSwapper`: stage-3 parameter shards on NVMe (`offload_param.device = "nvme"`).

A swapped parameter's shard (`ds_tensor`) lives in its swap file; in memory `ds_tensor` is a placeholder
of the shard's shape (one element, NaN: never plausible numbers). Around each gather the shard is read
into a slice of the pinned buffer pool (`acquire`) and made readable until the all-gather is done
(`release`). The coordinator starts the reads of the units ahead along the recorded execution order
(`prefetch`), so a gather normally finds its shards already read. Shards are written only when their
values change: by the optimizer step, `GatheredParameters(modifier_rank=...)`, or a load.

[Note: released shards stay in the pool] A released shard keeps its slice while nothing else needs the room,
and the next gather of that shard reads nothing. The pool is allocated once at its full size (`buffer_count`
x `buffer_size`), so holding on allocates nothing; on a host that maps unpinned pages at their first use it
does keep more of the configured pool resident than the gathers alone would (measured on the 0.6B benchmark:
+0.5 GiB of its 2.1 GB pool, for a forward that reads nothing; a variant that kept slices only in room
already mapped read almost as much as before, see benchmarks/RESULTS.md). Every write of a shard also lands
in its slice (`write`), so a kept slice never goes stale. When an allocation finds no room, the least
recently used kept slices go first (no I/O: their values are on disk), before read-ahead shards and before
the error. A forward and the backward after it visit the layers in opposite orders, so the layers the
backward touched last are the ones the next forward starts with: with a pool as large as the model (16
buffers hold the 0.6B benchmark's 9 layers) a step reads no parameter shard at all after the first.

[Note: write-back while nothing is given up] As long as the pool has never had to give up a kept slice
for room, a write to a shard with a slice goes to the slice only, and the shard is marked dirty: its file
is written when the slice is given up (`_free`: evicted, `drop_kept`, `drop_prefetched`), and the slice
is not handed out again before that write has landed. Then a model the pool holds whole writes no
parameter shard to disk after adoption (the 0.6B job: 1.2 GB less written per step). The first time an
allocation evicts a kept slice the swapper switches to writing through (the slice and the file at once)
for good, so a pool smaller than the model never waits on a dirty eviction's write in the middle of a
pass; the dirty shards left are written as they are given up. Nothing but this swapper reads the files
(copies outside a gather come from the slice, `read_copy`), so a dirty slice is never missed.

`max_in_cpu`: the first parameters (in the order given) whose shards total at most that many elements
stay in host memory and are never swapped (DeepSpeed's meaning of the key).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import ds_comm
from ds_ops.aio import AioError
from ds_zero._nvme.buffers import BufferPool, Slot, aligned_numel
from ds_zero._nvme.files import (
    NVMeSwapError,
    SwapFile,
    claim_finalizer,
    io_failure,
    make_aio_handle,
    prepare_swap_dir,
)
from ds_zero._params.partitioned_param import state_of

if TYPE_CHECKING:
    from ds_ops.aio import AioConfig
    from ds_zero.config import OffloadParamConfig

logger = logging.getLogger(__name__)

__all__ = ["ParamSwapper"]

_KEY = "zero_optimization.offload_param"
_STAGING_BUFFERS = 2  # writes in flight while the next shard is converted


def shard_placeholder(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The in-memory stand-in of a swapped shard: the right shape, one NaN element, not writable."""
    fill = float("nan") if dtype.is_floating_point else 0
    return torch.full((1,), fill, dtype=dtype).expand(numel)


@dataclass
class _Shard:
    param: nn.Parameter
    file: SwapFile
    slot: Slot | None = None
    users: int = 0
    pending: bool = False  # a read into `slot` was issued and not waited for
    verified: bool = False  # the slot holds the file's checked contents
    request: Any = None  # the read in flight into `slot` (its result carries the checksum)
    prefetched: bool = False
    dirty: bool = False  # the slot holds values its file does not have yet (see the write-back note)


class ParamSwapper:
    """Swaps the shards of stage-3 parameters between NVMe files and a pool of pinned buffers.

    Args:
        nvme_path: the directory for the swap files (`offload_param.nvme_path`).
        rank: the global rank (its own subdirectory).
        buffer_count: buffers in the pool (`offload_param.buffer_count`).
        buffer_size: elements per buffer (`offload_param.buffer_size`); every shard must fit one.
        max_in_cpu: shard elements kept in host memory instead of swapped (`offload_param.max_in_cpu`).
        pin_memory: page-lock the resident shards (`offload_param.pin_memory`).
        aio_config: the top-level `aio` section (None: its defaults).

    Raises:
        ValueError: the path is missing, not a directory or not writable; buffer_count is 0.
    """

    def __init__(
        self,
        *,
        nvme_path: str | os.PathLike[str] | None,
        rank: int,
        buffer_count: int,
        buffer_size: int,
        max_in_cpu: int,
        pin_memory: bool = False,
        aio_config: Mapping[str, Any] | AioConfig | None = None,
    ) -> None:
        if buffer_count < 1 or buffer_size < 1:
            raise ValueError(
                f"{_KEY}.buffer_count={buffer_count} and buffer_size={buffer_size}: NVMe parameter "
                "offload needs at least one buffer of at least one element; raise them"
            )
        self.dir = prepare_swap_dir(nvme_path, key=f"{_KEY}.nvme_path", rank=rank, kind="params")
        claim_finalizer(self, self.dir)
        self.handle = make_aio_handle(aio_config)
        self.buffer_count = buffer_count
        self.buffer_size = buffer_size
        self.max_in_cpu = max_in_cpu
        self.pin_memory = pin_memory
        self.resident_numel = 0
        self._shards: dict[int, _Shard] = {}
        self._pools: dict[torch.dtype, BufferPool] = {}
        self._prefetched_numel = 0
        # released shards whose slices still hold their values, least recently used first (see the note above)
        self._kept: OrderedDict[int, _Shard] = OrderedDict()
        # queued writes: (shard, source, its staging buffer, the aio request)
        self._writes: list[tuple[_Shard, torch.Tensor, torch.Tensor | None, Any]] = []
        self._staging: list[torch.Tensor] = []
        self.num_reads = 0
        self.num_writes = 0
        self.num_read_ahead_hits = 0  # gathers that found their shard already read ahead
        self.num_kept_hits = 0  # gathers that found their shard still in the pool from its last use
        self.write_back = True  # until an allocation first gives up a kept slice (see the write-back note)

    @classmethod
    def from_config(
        cls, config: OffloadParamConfig, *, rank: int, aio_config: Mapping[str, Any] | AioConfig | None = None
    ) -> ParamSwapper:
        return cls(
            nvme_path=config.nvme_path,
            rank=rank,
            buffer_count=config.buffer_count,
            buffer_size=config.buffer_size,
            max_in_cpu=config.max_in_cpu,
            pin_memory=config.pin_memory,
            aio_config=aio_config,
        )

    # --------------------------------------------------------------------------------- adoption
    def adopt(self, params: Sequence[nn.Parameter], *, keep: Sequence[nn.Parameter] = ()) -> int:
        """Take over the shards of `params` (partitioned, not yet swapped): keep up to `max_in_cpu` elements
        resident, write the others to their swap files and free their memory. Returns how many were swapped.

        `keep`: partitioned parameters that stay in memory whatever `max_in_cpu` says (the persistent
        ones); their shards are copied out of the model-wide shard buffer too, so that buffer can go.

        Raises:
            ValueError: a shard is larger than `buffer_size`.
            NVMeSwapError: a swap file could not be written (disk full, ...).
        """
        swapped: list[nn.Parameter] = []
        resident: list[nn.Parameter] = []
        for p in params:
            st = state_of(p)
            if st.swap is not None or st.shard_numel == 0:
                continue
            if self.resident_numel + st.shard_numel <= self.max_in_cpu:
                self.resident_numel += st.shard_numel
                resident.append(p)
                continue
            if st.shard_numel > self.buffer_size:
                raise ValueError(
                    f"{_KEY}.buffer_size={self.buffer_size} elements is smaller than the shard of "
                    f"parameter {st.name} ({st.shard_numel} elements on each rank); raise "
                    "buffer_size to at least the largest shard"
                )
            swapped.append(p)
        self._compact(resident + [p for p in keep if state_of(p).swap is None])
        for p in swapped:
            self._shards[p.ds_id] = _Shard(p, SwapFile(self.dir / f"param_{p.ds_id}.swp", ""))
        self._write([(p, p.ds_tensor) for p in swapped])
        self._settle_reads()  # a full disk is reported here, at construction
        self._free_staging()  # later writes mostly come from the shards' pool slices: no memory held for them
        for p in swapped:
            p.ds_tensor = shard_placeholder(state_of(p).shard_numel, p.ds_tensor.dtype)
            state_of(p).swap = self
        if swapped:
            logger.info(
                "NVMe offload: %d parameter shards (%d elements) swapped to %s, %d kept in host memory",
                len(swapped),
                sum(state_of(p).shard_numel for p in swapped),
                self.dir,
                len(resident),
            )
        return len(swapped)

    def _compact(self, params: list[nn.Parameter]) -> None:
        """Give resident shards their own buffer (they were views of the whole model's shard buffer)."""
        if not params:
            return
        by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
        for p in params:
            by_dtype.setdefault(p.ds_tensor.dtype, []).append(p)
        for dtype, group in by_dtype.items():
            flat = torch.empty(sum(state_of(p).shard_numel for p in group), dtype=dtype)
            if self.pin_memory:
                flat = ds_comm.get_accelerator().pin_memory(flat)
            offset = 0
            for p in group:
                view = flat[offset : offset + state_of(p).shard_numel]
                view.copy_(p.ds_tensor)
                p.ds_tensor = view
                offset += state_of(p).shard_numel

    def _pool(self, dtype: torch.dtype) -> BufferPool:
        pool = self._pools.get(dtype)
        if pool is None:
            sizes = [state_of(s.param).shard_numel for s in self._shards.values() if s.param.ds_tensor.dtype == dtype]
            total = sum(aligned_numel(n, dtype) for n in sizes)
            numel = min(self.buffer_size, max(aligned_numel(max(sizes, default=1), dtype), total))
            pool = BufferPool(self.handle, count=self.buffer_count, numel=numel, dtype=dtype)
            self._pools[dtype] = pool
            logger.info("NVMe offload: %d parameter swap buffers of %d elements (%s)", self.buffer_count, numel, dtype)
        return pool

    def swapped(self, param: nn.Parameter) -> bool:
        return param.ds_id in self._shards

    # ---------------------------------------------------------------------------------- reads
    def _label(self, shard: _Shard) -> str:
        return f"the shard of parameter {state_of(shard.param).name!r}"

    def _issue_read(self, shard: _Shard, slot: Slot) -> None:
        p = shard.param
        if self._writing(shard):  # read after write: let the write land first
            self._settle_reads()
        shard.file.label = self._label(shard)
        shard.file.check_before_read(state_of(p).shard_numel * p.ds_tensor.element_size())
        pool = self._pools[p.ds_tensor.dtype]
        shard.request = self.handle.async_pread(
            pool.view(slot, state_of(p).shard_numel), shard.file.path, checksum=True
        )
        shard.slot, shard.pending, shard.verified = slot, True, False
        self.num_reads += 1

    def _wait(self, op: str, files: list[SwapFile]) -> None:
        try:
            self.handle.wait()
        except AioError as err:
            raise io_failure(err, files, op) from err

    def _settle_reads(self) -> None:
        """Wait for every request in flight: reads (then usable) and queued writes (then checked and recorded)."""
        pending = [s for s in self._shards.values() if s.pending]
        writes, self._writes = self._writes, []
        if pending or writes:
            if writes and not pending:
                self._wait("write", [s.file for s, _, _, _ in writes])
            else:
                self._wait("read", [s.file for s in pending] + [s.file for s, _, _, _ in writes])
            for s in pending:
                s.pending = False
            for shard, src, _stage, request in writes:
                shard.file.recorded(src, request.result.checksum)

    def settle(self) -> None:
        """Finish every queued read and write (before the swap files are read by anyone else)."""
        self._settle_reads()

    def acquire(self, params: Sequence[nn.Parameter], label: str = "") -> None:
        """Make the swapped shards of `params` readable in `ds_tensor` until `release` (reads and checks them).

        Raises:
            ValueError: the buffers cannot hold these shards at once (raise buffer_count or buffer_size).
            NVMeSwapError: a swap file is missing, truncated, corrupted or unreadable.
        """
        shards = [self._shards[p.ds_id] for p in params]
        needed = {p.ds_id for p in params}
        for shard in shards:
            if shard.slot is None:
                pool = self._pool(shard.param.ds_tensor.dtype)
                slot = self._alloc(pool, state_of(shard.param).shard_numel, keep=needed)
                if slot is None:
                    self._drop_prefetched(keep=shards)
                    slot = pool.alloc(state_of(shard.param).shard_numel)
                if slot is None:
                    need = sum(pool.reserved(state_of(s.param).shard_numel) for s in shards)
                    raise ValueError(
                        f"{_KEY}: the {pool.count} swap buffers of {pool.numel} elements cannot hold the "
                        f"shards needed at once for {label or 'this gather'} ({len(shards)} shards, "
                        f"{need} elements with alignment, {pool.used_numel} in use); raise buffer_count "
                        "or buffer_size"
                    )
                self._issue_read(shard, slot)
        self._settle_reads()
        for shard in shards:
            p = shard.param
            view = self._pools[p.ds_tensor.dtype].view(shard.slot, state_of(p).shard_numel)
            if not shard.verified:
                shard.file.verify(view, shard.request.result.checksum if shard.request is not None else None)
                shard.verified, shard.request = True, None
            if shard.prefetched:
                shard.prefetched = False
                self._prefetched_numel -= shard.slot[2]
                self.num_read_ahead_hits += 1
            if self._kept.pop(p.ds_id, None) is not None:
                self.num_kept_hits += 1
            shard.users += 1
            p.ds_tensor = view

    def release(self, params: Sequence[nn.Parameter]) -> None:
        """The gather that needed these shards is done: `ds_tensor` is a placeholder again, and each slice
        stays in the pool as the most recently used kept one until an allocation needs its room."""
        for p in params:
            shard = self._shards[p.ds_id]
            shard.users -= 1
            if shard.users == 0:
                p.ds_tensor = shard_placeholder(state_of(p).shard_numel, p.ds_tensor.dtype)
                self._kept[p.ds_id] = shard

    def _alloc(self, pool: BufferPool, numel: int, keep: set[int] | frozenset[int] = frozenset()) -> Slot | None:
        """A slice of `pool`, giving up kept slices (least recently used first, none of the `keep` ids) while
        there is no room."""
        slot = pool.alloc(numel)
        while slot is None and self._kept:
            for key, shard in self._kept.items():
                if key not in keep and self._pools[shard.param.ds_tensor.dtype] is pool:
                    self.write_back = False
                    self._free(shard)
                    break
            else:
                return None
            slot = pool.alloc(numel)
        return slot

    def _free(self, shard: _Shard) -> None:
        p = shard.param
        self._kept.pop(p.ds_id, None)
        if shard.dirty:
            self._flush(shard)
        if shard.slot is not None and self._writing(shard):  # the slice is the source of a write in flight
            self._settle_reads()
        if shard.slot is not None:
            self._pools[p.ds_tensor.dtype].free(shard.slot)
            if shard.prefetched:
                self._prefetched_numel -= shard.slot[2]
        shard.slot, shard.verified, shard.prefetched = None, False, False
        p.ds_tensor = shard_placeholder(state_of(p).shard_numel, p.ds_tensor.dtype)

    def prefetch(self, params: Sequence[nn.Parameter]) -> bool:
        """Start reading the shards of `params` (no wait). False once a quarter of the pool holds prefetched shards
        (the rest stays free for the gathers in progress); the caller stops looking further ahead then."""
        for p in params:
            shard = self._shards[p.ds_id]
            if shard.slot is not None:
                if p.ds_id in self._kept:  # needed soon: the last to give up its room
                    self._kept.move_to_end(p.ds_id)
                continue
            pool = self._pool(p.ds_tensor.dtype)
            if self._prefetched_numel + pool.reserved(state_of(p).shard_numel) > pool.capacity // 4:
                return False
            slot = self._alloc(pool, state_of(p).shard_numel)
            if slot is None:
                return False
            try:
                self._issue_read(shard, slot)
            except NVMeSwapError:  # reported by the gather that needs it, with its context
                pool.free(slot)
                shard.slot = None
                continue
            shard.prefetched = True
            self._prefetched_numel += slot[2]
        return True

    def drop_kept(self) -> None:
        """Give up the kept slices of released shards (writing the dirty ones to their files first): the next
        gather of each reads (and checks) its swap file."""
        for shard in list(self._kept.values()):
            self._free(shard)

    def drop_prefetched(self) -> None:
        """Forget read-ahead shards nothing uses (the execution order changed, or the iteration ended)."""
        self._drop_prefetched(keep=[])

    def _drop_prefetched(self, keep: Sequence[_Shard]) -> None:
        keep_ids = {id(s) for s in keep}
        victims = [s for s in self._shards.values() if s.prefetched and s.users == 0 and id(s) not in keep_ids]
        if victims:
            self._settle_reads()  # a buffer must not be reused while a read still lands in it
            for shard in victims:
                self._free(shard)

    # ---------------------------------------------------------------------------------- writes
    def write(self, params: Sequence[nn.Parameter], values: Sequence[torch.Tensor]) -> None:
        """Store new shard values (each `shard_numel` elements, any float dtype) in the swap files.

        A shard that is currently read in also gets the values in its buffer.

        Raises:
            NVMeSwapError: a write failed (disk full, file-size limit, I/O error).
        """
        self._write(list(zip(params, values, strict=True)))

    def _write(self, items: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
        """Queue the writes; they settle (checked and recorded) before the next read or wait of the handle.

        A shard with a slice in the pool (in use, or kept) gets the values there and is written from it; any
        other is converted into a reused aligned staging buffer. Either way no allocation, no page faults, the
        zero-copy O_DIRECT path, and the caller's tensor is free again when this returns. A slice with a write
        in flight is not handed out again before the write has landed (`_free`).
        """
        if not items:
            return
        for p, value in items:
            shard = self._shards[p.ds_id]
            dtype = p.ds_tensor.dtype
            numel = state_of(p).shard_numel
            if shard.pending or self._writing(shard):  # its slot's old values still landing, or the file busy
                self._settle_reads()
            stage: torch.Tensor | None = None
            if shard.slot is not None:
                src = self._pools[dtype].view(shard.slot, numel)
                shard.verified = True
            else:
                stage = self._staging_buffer(dtype, numel)
                src = stage[:numel]
            with torch.no_grad():
                src.copy_(value.detach().reshape(-1))
            if stage is None and self.write_back:
                shard.dirty = True  # written when the slice is given up
                continue
            self._issue_write(shard, src, stage)

    def _issue_write(self, shard: _Shard, src: torch.Tensor, stage: torch.Tensor | None) -> None:
        shard.file.label = self._label(shard)  # what a failed write's error names
        request = self.handle.async_pwrite(src, shard.file.path, checksum=True)
        self._writes.append((shard, src, stage, request))
        shard.dirty = False
        self.num_writes += 1

    def _flush(self, shard: _Shard) -> None:
        """Write a dirty shard's slice to its file (queued; `_free` waits for it before the slice goes)."""
        assert shard.slot is not None
        dtype = shard.param.ds_tensor.dtype
        self._issue_write(shard, self._pools[dtype].view(shard.slot, state_of(shard.param).shard_numel), None)

    def _writing(self, shard: _Shard) -> bool:
        return any(queued is shard for queued, _, _, _ in self._writes)

    def _staging_buffer(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """A free staging buffer of at least `numel` elements of `dtype` (settles the writes when all are busy)."""
        busy = {id(stage) for _, _, stage, _ in self._writes if stage is not None}
        for stage in self._staging:
            if id(stage) not in busy and stage.dtype == dtype and stage.numel() >= numel:
                return stage
        if len(self._staging) >= _STAGING_BUFFERS and self._writes:
            self._settle_reads()
            return self._staging_buffer(dtype, numel)
        size = max(numel, max((state_of(s.param).shard_numel for s in self._shards.values()), default=numel))
        stage = self.handle.new_cpu_locked_tensor(size, torch.empty(0, dtype=dtype))
        self._staging.append(stage)
        return stage

    def read_copy(self, param: nn.Parameter) -> torch.Tensor:
        """A fresh host copy of a swapped shard's values (checked), without using the pool."""
        shard = self._shards[param.ds_id]
        if shard.slot is not None and shard.verified and not shard.pending:
            return self._pools[param.ds_tensor.dtype].view(shard.slot, state_of(param).shard_numel).clone()
        self._settle_reads()
        out = torch.empty(state_of(param).shard_numel, dtype=param.ds_tensor.dtype)
        shard.file.label = self._label(shard)
        shard.file.check_before_read(out.numel() * out.element_size())
        self.handle.async_pread(out, shard.file.path)
        self._wait("read", [shard.file])
        shard.file.verify(out)
        return out

    def close(self) -> None:
        """Free the buffers (the parameters must not be used afterwards)."""
        self._settle_reads()
        for shard in list(self._shards.values()):
            if shard.users == 0:
                shard.dirty = False  # nothing reads the files after this
                self._free(shard)
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self._free_staging()

    def _free_staging(self) -> None:
        """Free the staging buffers (no write may be in flight)."""
        for stage in self._staging:
            self.handle.free_cpu_locked_tensor(stage)
        self._staging = []
