"""Coalesced all-gather of partitioned parameters, guarded by a cross-rank fingerprint check.

[Note: why a fingerprint before every gather]
A coalesced all-gather whose size differs across ranks does not fail cleanly on gloo: the process aborts
inside the backend. Ranks disagree on what to gather when control flow depends on the data (rank 1 skips
a layer rank 0 runs). So before a *checked* data collective every rank all-gathers a 3-element
fingerprint (a hash of the parameter names, the element count, the number of parameter gathers issued
so far) on a separate process group; it has a fixed size and so can never abort. Matching fingerprints
make the data collective safe; a mismatch raises `GatherDivergenceError` on every rank, naming what each
rank tried to gather; a rank that never reaches the gather makes the others time out on the
fingerprint, which is reported the same way.

Gathers that follow an execution trace every rank recorded identically (see `_schedule.trace`) skip the
fingerprint (*unchecked*): while each rank's execution matches the shared trace, their sequences of
parameter gathers are identical by construction. A rank whose execution leaves the trace goes back to
checked gathers and posts what it ran to the c10d store; parameter gathers run on their own process
group, so a rank that left the trace can never meet another rank's unchecked gather with a different
collective. The ranks still on the trace then time out in their gather and report the deviations posted
by the others.

With hpZ (`_params.secondary`), a parameter whose secondary slice is current is gathered inside its
block of ranks from that slice; the fingerprint check still runs over all data-parallel ranks.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_zero._buffer_pool import BufferPool
from ds_zero._params.partitioned_param import state_of
from ds_zero._params.placement import family_runs
from ds_zero._params.secondary import SecondaryPartition, fill_secondary
from ds_zero._params.shards import acquire_shards

logger = logging.getLogger(__name__)

__all__ = [
    "GatherDivergenceError",
    "GatherHandle",
    "MultipleAllGatherHandles",
    "deviation_summary",
    "gather_params",
    "name_fingerprint",
    "report_deviation",
]

_MASK = (1 << 61) - 1


class GatherDivergenceError(ds_comm.CollectiveError):
    """Ranks disagreed on which partitioned parameters to gather (data-dependent control flow)."""


def name_fingerprint(name: str) -> int:
    """A stable 60-bit hash of a parameter's name (Python's `hash` of a str differs between processes)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little") & ((1 << 60) - 1)


def _comm_device(group: ProcessGroup | None) -> torch.device:
    """Where small control tensors must live for `group`'s backend (nccl: the accelerator; else the host)."""
    if ds_comm.is_initialized() and torch.distributed.get_backend(group) == "nccl":
        return ds_comm.get_accelerator().device()
    return torch.device("cpu")


def _fingerprint(params: Sequence[torch.nn.Parameter], tag: int = 0) -> tuple[int, int]:
    """(hash of `tag` and the parameter names in order, total elements)."""
    h = tag & _MASK
    total = 0
    for p in params:
        fp = state_of(p).fingerprint
        if fp is None:  # not attached to a model yet (under Init): the shape is what all ranks agree on
            fp = name_fingerprint(repr(tuple(p.ds_shape)))
        h = (h * 1_000_003 + fp) & _MASK
        total += p.ds_numel
    return h, total


def check_same_gather(
    params: Sequence[torch.nn.Parameter], label: str, fp_group: ProcessGroup | None, seq: int = 0, tag: int = 0
) -> None:
    """Verify that every rank in `fp_group` is about to gather the same parameters; raise naming them if not.

    Every rank must call it (one 3-element all-gather on `fp_group`; on a mismatch, one object all-gather).
    `seq` is how many parameter gathers this rank issued before on the data group; `tag` distinguishes
    checks that gather nothing (a departure from the recorded order).
    """
    world = ds_comm.get_world_size(fp_group)
    if world == 1:
        return
    h, total = _fingerprint(params, tag)
    device = _comm_device(fp_group)
    mine = torch.tensor([h, total, seq], dtype=torch.int64, device=device)
    rows = torch.empty(world * 3, dtype=torch.int64, device=device)
    rank = ds_comm.get_rank(fp_group)
    try:
        ds_comm.all_gather_into_tensor(rows, mine, group=fp_group)
    except ds_comm.CollectiveTimeoutError as err:
        raise GatherDivergenceError(
            f"rank {rank} waited at a parameter gather ({label}) but the other ranks never reached a matching "
            "gather within the collective timeout: the ranks ran different modules (data-dependent control "
            "flow around partitioned modules?). Stage 3 needs every rank to run the same partitioned "
            f"modules in the same order.{deviation_summary(fp_group)}"
        ) from err
    rows = rows.view(world, 3).cpu()
    mine = mine.cpu()
    if bool((rows == mine).all()):
        return
    labels = _all_gather_text(f"{label} (gather #{seq})", fp_group, world)
    groups: dict[str, list[int]] = {}
    for r, text in enumerate(labels):
        groups.setdefault(text, []).append(r)
    detail = "; ".join(f"ranks {ranks} gather {text}" for text, ranks in groups.items())
    raise GatherDivergenceError(
        f"ranks diverged at a stage-3 parameter gather: {detail}. Every rank must run the same partitioned "
        "modules in the same order (no data-dependent control flow around them); make the branch identical "
        "on all ranks, or run the branch's modules on every rank."
    )


_LABEL_BYTES = 1024


def _all_gather_text(text: str, group: ProcessGroup | None, world: int) -> list[str]:
    """Every rank's `text` (UTF-8, cut to 1 KiB) through a fixed-size byte all-gather.

    `all_gather_object` would do, but it needs numpy, which ds-zero does not depend on.
    """
    data = text.encode("utf-8")[:_LABEL_BYTES]
    device = _comm_device(group)
    mine = torch.zeros(_LABEL_BYTES, dtype=torch.uint8)
    mine[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    rows = torch.empty(world * _LABEL_BYTES, dtype=torch.uint8, device=device)
    ds_comm.all_gather_into_tensor(rows, mine.to(device), group=group)
    return [bytes(row.tolist()).rstrip(b"\0").decode("utf-8", errors="replace") for row in rows.view(world, -1)]


_DEVIATION_KEY = "ds_zero/stage3/deviation"


def _store() -> object | None:
    try:
        return torch.distributed.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def report_deviation(message: str) -> None:
    """Post this rank's latest departure from the recorded execution order (read by ranks that time out)."""
    store = _store()
    if store is not None:
        try:
            store.set(f"{_DEVIATION_KEY}/{ds_comm.get_rank()}", message)
        except RuntimeError:
            pass


def deviation_summary(group: ProcessGroup | None) -> str:
    """What the other ranks posted with `report_deviation` (empty when nothing or no store)."""
    store = _store()
    if store is None or ds_comm.get_world_size(group) == 1:
        return ""
    found = []
    for r in range(ds_comm.get_world_size(group)):
        rank = ds_comm.get_global_rank(group, r)
        key = f"{_DEVIATION_KEY}/{rank}"
        try:
            if store.check([key]):
                found.append(store.get(key).decode())
        except RuntimeError:
            continue
    return (" Reported by the ranks: " + "; ".join(found) + ".") if found else ""


#: The send and receive buffers of parameter gathers, reused step after step (see `_buffer_pool`).
GATHER_BUFFERS = BufferPool()


class GatherHandle:
    """An issued coalesced gather; `wait()` fills every parameter's full storage and marks it available."""

    __slots__ = (
        "params",
        "_recv",
        "_work",
        "_sizes",
        "_world",
        "_label",
        "_group",
        "_release",
        "_fill",
        "_pooled",
        "_direct",
    )

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        recv: torch.Tensor | None,
        work: ds_comm.CollectiveHandle | None,
        world: int,
        label: str = "",
        group: ProcessGroup | None = None,
        release: Callable[[], None] | None = None,
        sizes: list[int] | None = None,
        fill: SecondaryPartition | None = None,
        pooled: tuple[torch.Tensor, ...] = (),
        direct: bool = False,
    ) -> None:
        self.params = params
        self._recv = recv
        self._pooled = pooled  # buffers from GATHER_BUFFERS, handed back once the gather is complete
        self._direct = direct  # the collective writes into the full storages themselves (no `recv`)
        self._work = work
        # elements each of the `world` senders contributed per parameter (their shard, or their hpZ slice)
        self._sizes = sizes if sizes is not None else [state_of(p).shard_numel for p in params]
        self._fill = fill  # hpZ: keep this rank's secondary slice of what was gathered
        self._world = world
        self._label = label
        self._group = group
        self._release = release  # gives NVMe-swapped shards' buffers back once the collective read them

    def wait(self, handle_dependency: bool = True) -> None:
        """Complete the gather. `handle_dependency` is DeepSpeed's flag for deferring the free of the
        receive buffer on asynchronous devices; here the buffer is consumed before `wait` returns, so
        it changes nothing."""
        del handle_dependency
        if self._recv is None and not self._direct:
            return
        if self._work is not None:
            try:
                self._work.wait()
            except ds_comm.CollectiveTimeoutError as err:
                raise GatherDivergenceError(
                    f"rank {ds_comm.get_rank()}: the parameter gather of {self._label} did not complete within "
                    "the collective timeout: another rank ran different modules from here on (data-dependent "
                    f"control flow around partitioned modules?).{deviation_summary(self._group)}"
                ) from err
        if self._direct:
            self._direct = False
        else:
            assert self._recv is not None
            rows = self._recv.view(self._world, -1)
            outs = [
                state_of(p).gather_target().view(self._world, s) for p, s in zip(self.params, self._sizes, strict=True)
            ]
            with torch.no_grad():
                if len(outs) == 1:
                    outs[0].copy_(rows)
                else:
                    torch.split_with_sizes_copy(rows, self._sizes, dim=1, out=outs)
        for p in self.params:
            state_of(p).finish_gather()
        if self._fill is not None:
            for p in self.params:
                if not p.ds_persist:
                    fill_secondary(p, self._fill)
        self._recv = None
        self._work = None
        for buf in self._pooled:
            GATHER_BUFFERS.give(buf)
        self._pooled = ()
        if self._release is not None:
            self._release()
            self._release = None


class MultipleAllGatherHandles:
    """Several issued gathers waited on as one (`gather_params` issues one per dtype).

    `wait(handle_dependency=...)` forwards the flag to every handle by keyword, so handles whose `wait`
    takes it keyword-only (or as `**kwargs`) are waited on as well as positional ones.
    """

    __slots__ = ("handles",)

    def __init__(self, handles: Sequence[Any]) -> None:
        self.handles = list(handles)

    def wait(self, handle_dependency: bool = True) -> None:
        for handle in self.handles:
            handle.wait(handle_dependency=handle_dependency)


def gather_params(
    params: list[torch.nn.Parameter],
    *,
    group: ProcessGroup | None,
    fp_group: ProcessGroup | None,
    label: str,
    async_op: bool = False,
    checked: bool = True,
    seq: int = 0,
    secondary: SecondaryPartition | None = None,
    _split: bool = True,
) -> list[GatherHandle]:
    """All-gather the full values of `params` (one collective per dtype), after the fingerprint check.

    Args:
        params: partitioned parameters of `group`, in the same order on every rank.
        group: the group to gather on (the parameters' data-parallel ranks).
        fp_group: the group for the fingerprint check (a separate group over the same ranks).
        label: what is being gathered, for the divergence error ("module 'layers.1.mlp'").
        async_op: return handles still in flight (their parameters are marked INFLIGHT) instead of waiting.
        checked: run the fingerprint check first (False only for gathers taken from a shared trace).
        seq: parameter gathers issued on `group` before this one (part of the fingerprint).
        secondary: this rank's hpZ block (None: hpZ off). Parameters with a current secondary slice are
            gathered in the block from it (one more collective per dtype); the others from their primary
            shards, refreshing their slices.
        _split: internal (False: `params` are known to be of one family, `group`'s).

    Parameters of a placement family (`ds_zero._params.placement`: AutoEP experts) are gathered over their
    family's group instead of `group`, family by family in order of first appearance (the same on every
    rank); the fingerprint check covers them all.

    Returns:
        One handle per dtype (and, with hpZ, per source); already waited on unless `async_op`.
    """
    if checked:
        check_same_gather(params, label, fp_group, seq)
    runs = family_runs(params) if _split and params else [(None, params)]
    if len(runs) > 1 or runs[0][0] is not None:
        # placement families (AutoEP experts): each family's shards are gathered over its own group, one run
        # after the other in the same order on every rank (`_params.placement`)
        handles = []
        for family, run in runs:
            handles += gather_params(
                run,
                group=group if family is None else family,
                fp_group=fp_group,
                label=label,
                async_op=async_op,
                checked=False,
                secondary=secondary if family is None else None,
                _split=False,
            )
        return handles
    world = ds_comm.get_world_size(group)
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    from_secondary: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        st = state_of(p)
        (from_secondary if secondary is not None and st.secondary_valid else by_dtype).setdefault(
            st.full.dtype, []
        ).append(p)
    handles = []
    if secondary is not None:
        for dtype, batch in from_secondary.items():
            handles.append(_gather_secondary(batch, dtype, secondary, label, fp_group, async_op))
    for dtype, batch in by_dtype.items():
        device = state_of(batch[0]).full.device
        release = acquire_shards(batch, label)  # NVMe-swapped shards are read into pinned buffers
        with torch.no_grad():
            if world == 1 and all(p.ds_tensor.device == device and p.ds_tensor.dtype == dtype for p in batch):
                # one rank: each shard is the whole parameter; copied straight into its full storage
                for p in batch:
                    st = state_of(p)
                    st.start_gather()
                    st.gather_target()[: p.ds_tensor.numel()].copy_(p.ds_tensor)
                    st.finish_gather()
                if release is not None:
                    release()
                handles.append(GatherHandle(batch, None, None, 1))
                continue
            pooled: tuple[torch.Tensor, ...] = ()
            shards = [p.ds_tensor for p in batch]
            if world == 2 and release is None and secondary is None:
                direct = _gather_in_place(batch, shards, dtype, device, group, label, fp_group, async_op)
                if direct is not None:
                    handles.append(direct)
                    continue
            if world > 1 and len(batch) > 1 and all(t.device == device and t.dtype == dtype for t in shards):
                send = torch.cat(shards, out=GATHER_BUFFERS.take(sum(t.numel() for t in shards), dtype, device))
                pooled = (send,)
            else:
                send = torch.cat(shards) if len(batch) > 1 else batch[0].ds_tensor
                # from a swap buffer, the copy must be complete before the buffer is reused
                send = send.to(device=device, dtype=dtype, non_blocking=release is None)
            if world == 1:
                handle = GatherHandle(batch, send, None, 1, release=release)
            else:
                recv = GATHER_BUFFERS.take(send.numel() * world, dtype, device)
                work = ds_comm.all_gather_into_tensor(recv, send, group=group, async_op=True)
                handle = GatherHandle(
                    batch, recv, work, world, label, fp_group, release=release, fill=secondary, pooled=(*pooled, recv)
                )
        for p in batch:
            state_of(p).start_gather()
        if not async_op:
            handle.wait()
        handles.append(handle)
    return handles


def _gather_in_place(
    batch: list[torch.nn.Parameter],
    shards: list[torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    group: ProcessGroup | None,
    label: str,
    fp_group: ProcessGroup | None,
    async_op: bool,
) -> GatherHandle | None:
    """Two gloo CPU ranks: each shard goes straight from the peer into the parameter's own full storage
    (`ds_comm.pair_all_gather_into_tensors`), skipping the send concatenation, the receive buffer and the
    copy out of it (about a third of ZeRO-3's per-step gather cost on CPU). None, nothing issued, when the
    group or the shards do not allow it."""
    if not all(t.device == device and t.dtype == dtype and t.is_contiguous() for t in shards):
        return None
    states = [state_of(p) for p in batch]
    before = [p.ds_status for p in batch]
    for st in states:
        st.start_gather()
    targets = [st.gather_target() for st in states]
    work = ds_comm.pair_all_gather_into_tensors(targets, shards, group=group)
    if work is None:
        for p, status in zip(batch, before, strict=True):  # back to where it was; the caller gathers another way
            p.ds_status = status
        return None
    handle = GatherHandle(batch, None, work, 2, label, fp_group, direct=True)
    if not async_op:
        handle.wait()
    return handle


def _gather_secondary(
    batch: list[torch.nn.Parameter],
    dtype: torch.dtype,
    part: SecondaryPartition,
    label: str,
    fp_group: ProcessGroup | None,
    async_op: bool,
) -> GatherHandle:
    """Issue the in-block all-gather of `batch`'s secondary slices (see `_params.secondary`)."""
    slices = [p.ds_secondary_tensor for p in batch]
    device = state_of(batch[0]).full.device
    with torch.no_grad():
        send = torch.cat(slices) if len(slices) > 1 else slices[0]
        send = send.to(device=device, dtype=dtype)
        recv = torch.empty(send.numel() * part.size, dtype=dtype, device=device)
        work = ds_comm.all_gather_into_tensor(recv, send, group=part.group, async_op=True)
    handle = GatherHandle(
        batch, recv, work, part.size, f"{label} (hpZ block)", fp_group, sizes=[s.numel() for s in slices]
    )
    for p in batch:
        state_of(p).start_gather()
    if not async_op:
        handle.wait()
    return handle


def broadcast_full(params: Sequence[torch.nn.Parameter], src_rank: int, group: ProcessGroup | None) -> None:
    """Broadcast the (available) full values of `params` from `src_rank` of `group` into every rank's copy."""
    if ds_comm.get_world_size(group) == 1 or not params:
        return
    src = ds_comm.get_global_rank(group, src_rank) if group is not None else src_rank
    by_dtype: dict[torch.dtype, list[torch.nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    with torch.no_grad():
        for batch in by_dtype.values():
            flat = torch.cat([p.data.reshape(-1) for p in batch])
            ds_comm.broadcast(flat, src=src, group=group)
            offset = 0
            for p in batch:
                p.data.copy_(flat[offset : offset + p.numel()].view_as(p.data))
                offset += p.numel()
