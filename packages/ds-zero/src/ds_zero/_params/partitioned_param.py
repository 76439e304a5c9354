"""A stage-3 parameter: a real `nn.Parameter` that keeps its full shape while each rank holds 1/N of it.

[Note: how a released parameter keeps its shape]
Every partitioned parameter stays the same `nn.Parameter` object for its whole life (optimizers, hooks
and `named_parameters()` keep working), and its `.data` switches between two tensors of the *full* shape:

* released: a one-element tensor expanded to the full shape (all strides 0), filled with NaN. `shape`,
  `dtype`, `device` and `numel()` are the logical values, the tensor costs one element, reading it gives
  NaN (visible, never silently plausible numbers), and writing into it raises torch's "more than one
  element of the written-to tensor refers to a single memory location" error.
* available: `ZeroParamState.full`, a view of a storage this module owns. Releasing gives `.data` back
  the placeholder and then frees the gathered memory *only if nothing else holds it* (see [Note: a
  release never frees memory another tensor holds]).

[Note: a release never frees memory another tensor holds]
User code keeps tensors taken while a parameter is gathered: DeepSpeed-Chat's `save_zero_three_model`
collects `p.data.cpu()` (on a CPU host, the same storage) inside `GatheredParameters([p])` and saves
them after the block; `model.state_dict()` inside the block holds `p.detach()`; a forward hook keeps a
view of a weight. So a release counts the storage's references. When only this module's own tensors
(`full_flat`, `full`) hold it, the storage is shrunk to 0 bytes in place (`untyped_storage().resize_(0)`)
and the next gather grows and refills the same storage. When anything else holds it, the storage is
left to its holders (freed by refcount when the last one drops it, never written again by ds) and the
parameter gets a new, empty full storage for its next gather: the holders keep the values they saw, as
in DeepSpeed, whose release drops the parameter's reference rather than the memory. In the training
loop nothing else holds it (autograd's saved tensors are markers, see `_schedule.saved_tensors`), so each
release frees the memory in place. One exception: torch's non-reentrant activation checkpointing keeps
the views its recomputation made until the module's backward; a release in between (only when
`stage3_max_reuse_distance` is shorter than the way to that backward) leaves that memory to the
checkpoint until the backward has used it, and the backward's gather fills a new storage.

The local shard and partition metadata are reachable with DeepSpeed's attribute names: `ds_tensor` (this
rank's flat, zero-padded slice), `ds_shape`, `ds_numel`, `ds_status`, `ds_persist`, `ds_id`,
`ds_process_group`, `ds_param_type`, `ds_active_sub_modules` (a read-only view, see `_params.active_consumers`),
`is_external_param` (True once a forward returned it to its caller, which gathers it from then on), and
`ds_secondary_tensor` (hpZ's slice, see `_params.secondary`;
None without hpZ). Rank `r` holds elements `[r * s, (r + 1) * s)` of the flattened parameter, where
`s = ceil(numel / world_size)`; the last ranks hold zero padding past `numel`.

[Note: user-facing attributes vs internal state]
Only those DeepSpeed names live on the parameter, as plain attributes (code written for DeepSpeed, such
as HF transformers, reads and sets them directly; a property would need a Parameter subclass, which
changes `type(param)` for everyone). Everything else this package tracks per parameter (the full
storage, use count, owning coordinator, NVMe swapper, the optimizer holding its master, ...) is one
`ZeroParamState` reached through `state_of(param)`: a typed, slotted record, like FSDP2's per-parameter
`FSDPParam`. The optimizer's own per-parameter bookkeeping (master slice, gradient bucket and slot) lives
in its `_stage3.partition_index.PartitionIndex`, not here. No
value is kept in both places, so nothing has to be kept in sync; `ds_status` is written only here (and
set once, NOT_AVAILABLE, when `partitioning` makes the parameter).

[Note: the state owns its transitions]
As FSDP2's `FSDPParam` does for its parameter, `ZeroParamState` moves its parameter between the statuses,
and each move checks the status it starts from: `start_gather` (NOT_AVAILABLE, or AVAILABLE for a regather
of changed shards, to INFLIGHT), `gather_target` and `finish_gather` (INFLIGHT, to AVAILABLE), `materialize`
(NOT_AVAILABLE to AVAILABLE with values a load overwrites) and `release` (AVAILABLE to NOT_AVAILABLE). A move
from any other status is a bug in the schedule, so it raises a RuntimeError naming the parameter's
`ds_id`, name and status at once, instead of gathering into a storage a pending gather still fills or
freeing memory twice. The state refers to its parameter weakly (`param`): the parameter owns the state.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from ds_zero._params.storage_pool import released_storages

logger = logging.getLogger(__name__)

__all__ = ["MasterSink", "ZeroParamState", "ZeroParamStatus", "ZeroParamType", "is_zero_param", "state_of"]


class MasterSink(Protocol):
    """Where a write of a shard's values goes on to the fp32 master (the stage-3 optimizer's partition index)."""

    def write_master(self, param: torch.nn.Parameter, piece: torch.Tensor) -> None:
        """Write this rank's unpadded slice `piece` of `param`'s values into its master, zero-padded."""
        ...


class ZeroParamStatus(enum.Enum):
    """Where a partitioned parameter's full values are (DeepSpeed's names)."""

    AVAILABLE = 1
    """Gathered: `.data` holds the full values."""
    NOT_AVAILABLE = 2
    """Released: only `ds_tensor` (this rank's shard) holds values."""
    INFLIGHT = 3
    """An all-gather into the full storage has been issued and not yet waited on."""


class ZeroParamType(enum.Enum):
    """How a parameter is held across the ranks (DeepSpeed's names; `param.ds_param_type`)."""

    NORMAL = 1
    """A plain parameter, whole on every rank."""
    PARTITIONED = 2
    """Split across the data-parallel ranks (every stage-3 partitioned parameter here)."""
    REMOTE = 3
    """Held by one rank only (DeepSpeed's name; ds never creates such parameters)."""


@dataclasses.dataclass(slots=True, eq=False, repr=False)
class ZeroParamState:
    """This package's bookkeeping for one partitioned parameter on this rank (`state_of(param)`)."""

    name: str
    """The parameter's name in its model (`named_parameters()`), once a coordinator adopted it; until
    then a placeholder naming its id and shape. Checkpoints and error messages use it."""
    shard_numel: int
    """Elements of `ds_tensor`: `ceil(ds_numel / world_size)`."""
    world_size: int
    """Ranks of `ds_process_group` the parameter is split across."""
    rank: int
    """This rank's index in `ds_process_group` (which slice `ds_tensor` holds)."""
    offload: bool
    """The shard lives on another device than the full values (parameter offload)."""
    full_flat: torch.Tensor
    """The owned, padded (`shard_numel * world_size`) flat storage the full values are gathered into; 0
    bytes while released."""
    full: torch.Tensor
    """`full_flat[:ds_numel]` viewed in `ds_shape`: what `.data` points at while available."""
    placeholder: torch.Tensor
    """One NaN element expanded to `ds_shape`: what `.data` points at while released."""
    active: int = 0
    """Running modules, `GatheredParameters` blocks and on-demand reads using the full values now."""
    coord: Any = None
    """The `ParamCoordinator` that schedules the parameter's gathers (None: not yet adopted by a model)."""
    fingerprint: int | None = None
    """Hash of `name` for the gather check (None before a coordinator named it: the shape is used)."""
    master_sink: MasterSink | None = None
    """The stage-3 optimizer's index that holds this shard's fp32 master (None: no optimizer was built over
    the parameter). A write of the shard goes on to the master through it, and `.to()`/`.half()` are
    refused once it is set (the master would no longer match)."""
    swap: Any = None
    """The `ParamSwapper` holding the shard on NVMe (offload_param.device="nvme"); None: `ds_tensor` holds it."""
    secondary_valid: bool = False
    """hpZ: `ds_secondary_tensor` holds the current values (see `_params.secondary`); False: gather the primary."""
    api_held: bool = False
    """Held by `param.all_gather()` / `all_gather_coalesced()` until `param.partition()` (`_params.param_methods`)."""
    api_standalone: bool = False
    """That gather was outside any coordinator (so `partition()` frees the full value itself)."""
    own_refs: int | None = None
    """References to the full storage from `full_flat` and `full` alone (None: torch cannot count them);
    a release that finds more leaves the storage to the other holders."""
    param_ref: Callable[[], torch.nn.Parameter | None] | None = None
    """The parameter this state belongs to, held weakly: the parameter holds its state, not the reverse."""

    @classmethod
    def released(
        cls,
        param: torch.nn.Parameter,
        *,
        name: str,
        shard_numel: int,
        world_size: int,
        rank: int,
        offload: bool,
        shape: torch.Size,
        device: torch.device,
        dtype: torch.dtype,
    ) -> ZeroParamState:
        """The state of `param`, newly partitioned: a fresh, released full storage of `shape`."""
        full_flat, full, placeholder = _full_storage(shard_numel * world_size, shape, device, dtype)
        return cls(
            name=name,
            shard_numel=shard_numel,
            world_size=world_size,
            rank=rank,
            offload=offload,
            full_flat=full_flat,
            full=full,
            placeholder=placeholder,
            own_refs=storage_refs(full_flat),
            param_ref=weakref.ref(param),
        )

    @property
    def param(self) -> torch.nn.Parameter:
        """The parameter this state belongs to."""
        param = None if self.param_ref is None else self.param_ref()
        if param is None:
            raise RuntimeError(f"stage 3: the state of {self.name} outlived its parameter")
        return param

    def _expect(self, action: str, *allowed: ZeroParamStatus) -> torch.nn.Parameter:
        """The parameter, after checking its status is one `action` starts from (a ds bug otherwise)."""
        param = self.param
        if param.ds_status not in allowed:
            raise RuntimeError(
                f"stage 3: cannot {action} parameter ds_id={param.ds_id} ({self.name}): its status is "
                f"{param.ds_status.name}, and {action} starts from {' or '.join(a.name for a in allowed)}"
            )
        return param

    def start_gather(self) -> None:
        """A gather into the full storage is issued: INFLIGHT until `finish_gather`.

        Starts from NOT_AVAILABLE, or AVAILABLE when the shards changed under gathered values (a regather
        after a step or a load); never from INFLIGHT, which would be two gathers into one storage.
        """
        param = self._expect("start a gather of", ZeroParamStatus.NOT_AVAILABLE, ZeroParamStatus.AVAILABLE)
        param.ds_status = ZeroParamStatus.INFLIGHT

    def gather_target(self) -> torch.Tensor:
        """The padded flat full storage, given its bytes (contents undefined), for an issued gather to fill."""
        self._expect("fill the gather of", ZeroParamStatus.INFLIGHT)
        return self._grow_storage()

    def finish_gather(self) -> None:
        """The issued gather has filled the full storage: point `.data` at it, AVAILABLE."""
        param = self._expect("finish the gather of", ZeroParamStatus.INFLIGHT)
        param.data = self.full
        param.ds_status = ZeroParamStatus.AVAILABLE

    def materialize(self) -> torch.Tensor:
        """Make a released parameter AVAILABLE with undefined full values, for a caller that overwrites them
        all (a state_dict load); returns the full tensor."""
        param = self._expect("materialize", ZeroParamStatus.NOT_AVAILABLE)
        self._grow_storage()
        param.data = self.full
        param.ds_status = ZeroParamStatus.AVAILABLE
        return self.full

    def release(self) -> None:
        """AVAILABLE to NOT_AVAILABLE: `.data` back to the placeholder; the gathered memory is freed unless
        something else holds it (see [Note: a release never frees memory another tensor holds])."""
        param = self._expect("release", ZeroParamStatus.AVAILABLE)
        param.data = self.placeholder
        if _held_elsewhere(self):
            old_key = self.full_flat.untyped_storage()._cdata
            self._new_storage(self.full.device, self.full.dtype, keep_placeholder=True)
            if self.coord is not None:
                self.coord.storage_replaced(old_key, param)
            logger.debug("stage 3: %s released while another tensor holds its values; they stay with it", self.name)
        else:
            storage = self.full_flat.untyped_storage()
            if not released_storages.take_from(storage):  # see [Note: why released full storages are pooled]
                storage.resize_(0)
        param.ds_status = ZeroParamStatus.NOT_AVAILABLE

    def _grow_storage(self) -> torch.Tensor:
        storage = self.full_flat.untyped_storage()
        need = self.shard_numel * self.world_size * self.full.element_size()
        if storage.nbytes() != need and not released_storages.fill(storage, need):
            storage.resize_(need)
        return self.full_flat

    def _new_storage(self, device: torch.device, dtype: torch.dtype, *, keep_placeholder: bool = False) -> None:
        """A new, released full storage of `device`/`dtype` replaces the current one (left to its holders)."""
        full_flat, full, placeholder = _full_storage(self.shard_numel * self.world_size, self.full.shape, device, dtype)
        self.full_flat, self.full = full_flat, full
        if not keep_placeholder:
            self.placeholder = placeholder
        self.own_refs = storage_refs(self.full_flat)

    def write_shard_from_full(self, full: torch.Tensor) -> None:
        """Copy this rank's slice of `full` (any shape with `ds_numel` elements) into the shard and the master.

        A shard or master swapped to NVMe is written to its swap file.
        """
        param = self.param
        flat = full.reshape(-1)
        self.secondary_valid = False
        s, rank, numel = self.shard_numel, self.rank, param.ds_numel
        start, end = min(rank * s, numel), min((rank + 1) * s, numel)
        with torch.no_grad():
            piece = flat[start:end]
            if self.swap is not None:
                padded = torch.zeros(s, dtype=param.ds_tensor.dtype)
                padded[: end - start].copy_(piece)
                self.swap.write([param], [padded])
            else:
                param.ds_tensor[: end - start].copy_(piece)
                param.ds_tensor[end - start :].zero_()
            if self.master_sink is not None:
                self.master_sink.write_master(param, piece)

    def convert(self, fn: Any) -> None:
        """Apply a `Module._apply` conversion (`.to(dtype)`, `.cuda()`, ...) to the partitioned parameter.

        The shard is converted; the full storage is recreated (released) in the converted dtype/device; a
        parameter that was available (persistent, or gathered) is converted and stays available.
        """
        param = self.param
        available = param.ds_status is ZeroParamStatus.AVAILABLE
        self.secondary_valid = False
        param.ds_secondary_tensor = None  # reallocated in the new dtype/device by the next primary gather
        with torch.no_grad():
            full = fn(self.full) if available else None
            if self.swap is not None:  # the shard is on NVMe: only a device move of the compute copy is possible
                probe = fn(torch.empty(0, dtype=param.ds_tensor.dtype))
                if probe.dtype != param.ds_tensor.dtype:
                    raise ValueError(
                        f"cannot convert partitioned parameter {self.name} to {probe.dtype}: its shard is "
                        "swapped to NVMe (offload_param.device='nvme') in "
                        f"{param.ds_tensor.dtype}; convert the model (or pass dtype= to ds_zero.Init) before "
                        "it is partitioned"
                    )
            else:
                shard = fn(param.ds_tensor)
                if self.offload and shard.device != param.ds_tensor.device:
                    shard = shard.to(param.ds_tensor.device)  # offloaded shards stay on the host
                param.ds_tensor = shard
            probe = fn(torch.empty(0, dtype=self.full.dtype, device=self.full.device))
            self._new_storage(probe.device, probe.dtype)
            if full is not None:
                self._grow_storage()
                self.full.copy_(full)
                param.data = self.full  # stays AVAILABLE
            else:
                param.data = self.placeholder

    def __repr__(self) -> str:
        # not the generated repr: printing `full` while released reads a 0-byte storage (a crash, not an error)
        return (
            f"ZeroParamState(name={self.name!r}, shard_numel={self.shard_numel}, world_size={self.world_size}, "
            f"rank={self.rank}, active={self.active}, offload={self.offload})"
        )


def state_of(param: torch.nn.Parameter) -> ZeroParamState:
    """The internal state of a partitioned parameter (see [Note: user-facing attributes vs internal state])."""
    return param._ds_state


def is_zero_param(param: Any) -> bool:
    """Whether `param` is a stage-3 partitioned parameter."""
    return isinstance(param, torch.nn.Parameter) and hasattr(param, "ds_id")


def shard_numel(numel: int, world_size: int) -> int:
    """Elements each rank holds for a parameter of `numel` elements (the last shards are zero-padded)."""
    return max(1, math.ceil(numel / world_size)) if numel else 0


def _placeholder(shape: torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    fill = float("nan") if dtype.is_floating_point or dtype.is_complex else 0
    return torch.full((1,), fill, dtype=dtype, device=device).expand(shape)


_use_count = getattr(torch._C, "_storage_Use_Count", None)


def storage_refs(t: torch.Tensor) -> int | None:
    """How many tensors (and storage handles) reference `t`'s storage; None where torch cannot tell."""
    return None if _use_count is None else _use_count(t.untyped_storage()._cdata)


def _held_elsewhere(st: ZeroParamState) -> bool:
    """Whether a tensor besides `st.full_flat` and `st.full` references the full storage (True if unknown)."""
    refs = storage_refs(st.full_flat)
    return refs is None or st.own_refs is None or refs > st.own_refs


def _full_storage(
    padded: int, shape: torch.Size, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A new owned full-size storage, released: (padded flat tensor, full-shape view, placeholder)."""
    full_flat = torch.empty(padded, dtype=dtype, device=device)
    full = full_flat[: math.prod(shape)].view(shape)
    full_flat.untyped_storage().resize_(0)  # views made first: a view of a 0-byte storage cannot be created
    return full_flat, full, _placeholder(shape, dtype, device)


def iter_zero_params(params: Iterable[Any]) -> list[torch.nn.Parameter]:
    """The partitioned parameters in `params`, deduplicated, in order (other objects are skipped)."""
    seen: set[int] = set()
    out = []
    for p in params:
        if is_zero_param(p) and id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out
