"""`DeepSpeedZeRoOffload`: stage-3 parameter management for one model, with or without an optimizer."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.utils.hooks import RemovableHandle

import ds_comm
from ds_zero._construct.init_base import InsertPostInitMethodToModuleSubClasses
from ds_zero._nvme.param_swapper import ParamSwapper
from ds_zero._params.partitioned_module import partition_module, remove_guard
from ds_zero._params.partitioned_param import is_zero_param, iter_zero_params, state_of
from ds_zero._params.placement import family_group, has_families
from ds_zero._params.secondary import secondary_partition
from ds_zero._params.storage_pool import released_storages
from ds_zero._schedule.coordinator import ParamCoordinator
from ds_zero._schedule.granularity import set_leaves_by_granularity
from ds_zero._schedule.hooks import install_hooks
from ds_zero._schedule.leaf_modules import apply_leaf_module_config
from ds_zero._zero_config import as_zero_config

if TYPE_CHECKING:
    from ds_ops.aio import AioConfig
    from ds_zero.config import ZeroConfig

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedZeRoOffload"]


class DeepSpeedZeRoOffload:
    """Partitions a model's parameters across the data-parallel ranks and schedules their gathers.

    At construction: every parameter not already partitioned (by `ds_zero.Init`) is partitioned, each
    rank keeping 1/N of it (on the host with `offload_param.device="cpu"`; in swap files under
    `offload_param.nvme_path` with "nvme", read back ahead of each gather: see `ds_zero._nvme.param_swapper`);
    parameters with fewer than
    `param_persistence_threshold` elements (up to `model_persistence_threshold` elements in total) are
    all-gathered once and stay whole ("persistent"); forward hooks are installed on every submodule. From
    then on, each forward and backward gathers a module's partitioned parameters just before it runs
    (one coalesced all-gather per module, prefetched along the recorded execution order) and releases
    them after, as described in `ds_zero._schedule.coordinator`; a leaf module (flagged with
    `ds_zero.set_z3_leaf_modules` or named by `zero_optimization.leaf_module`) gathers its whole subtree
    on entry instead (`ds_zero._schedule.leaf_modules`). This is all that evaluation without an
    optimizer needs; `DeepSpeedZeroOptimizer_Stage3` builds one of these for training.

    Args:
        module: the model (built normally, or under `ds_zero.Init`).
        config: the `zero_optimization` section (`ZeroConfig` or dict); its stage-3 keys apply.
        dp_group: the data-parallel group (None: the world).
        aio_config: the top-level `aio` section (dict or `ds_ops.AioConfig`) for NVMe offload (None: defaults).

    Raises:
        ValueError: the module is already managed, parameters were partitioned for a group of another size,
            or (NVMe offload) `nvme_path` is missing or not writable, or a shard exceeds `buffer_size`.
        NVMeSwapError: a swap file could not be written (disk full, file-size limit).

    With `zero_hpz_partition_size = h > 1` (ZeRO++ hpZ), each rank also keeps a 1/h slice of every
    parameter it gathered, and gathers it again within its block of h consecutive ranks until the end of
    the iteration (the backward's gathers): see `ds_zero._params.secondary`.

    Collectives: at construction, the creation of two groups over the data-parallel ranks (parameter
    gathers; gather fingerprints), with hpZ one group per block, and one all-gather of the persistent
    parameters; every rank must construct it, in the same order.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        config: ZeroConfig | Mapping[str, Any] | None = None,
        dp_group: ProcessGroup | None = None,
        aio_config: Mapping[str, Any] | AioConfig | None = None,
    ) -> None:
        cfg = as_zero_config(config)
        if getattr(module, "_ds_zero3", None) is not None:
            raise ValueError(
                "this module already has stage-3 parameter management (module._ds_zero3); pass that "
                "object as parameter_offload= instead of building a second one"
            )
        offload = cfg.offload_param_or_default
        self.module = module
        self.config = cfg
        self.dp_group = dp_group
        self.world_size = ds_comm.get_world_size(dp_group)
        # the swap directory is checked before the module is touched; shards that ds_zero.Init(remote_device=
        # "nvme") already swapped stay with its swapper, which takes the rest too (no second pool of buffers)
        self.param_swapper = (
            (_swapper_of(module) or ParamSwapper.from_config(offload, rank=ds_comm.get_rank(), aio_config=aio_config))
            if offload.device == "nvme"
            else None
        )
        shard_device = torch.device("cpu") if offload.device in ("cpu", "nvme") else None
        params = list(module.parameters())
        if params and not any(is_zero_param(p) for p in params):
            # DeepSpeed's engine partitions a model not built under Init through Init(module=...), which
            # installs its stage-3 linear over torch.nn.functional.linear (process-wide)
            linear = InsertPostInitMethodToModuleSubClasses(mem_efficient_linear=cfg.memory_efficient_linear)
            linear._enable_mem_efficient_linear()
        partition_module(
            module, group=dp_group, shard_device=shard_device, pin_memory=offload.pin_memory and offload.device == "cpu"
        )
        params = iter_zero_params(module.parameters())
        for p in params:
            if family_group(p) is None and (world := state_of(p).world_size) != self.world_size:
                raise ValueError(
                    f"parameter {tuple(p.ds_shape)} was partitioned over {world} ranks but the "
                    f"data-parallel group has {self.world_size}; use the same group in ds_zero.Init "
                    "(data_parallel_group=) and here (dp_group=)"
                )
        hpz = cfg.zero_hpz_partition_size
        if hpz > 1 and has_families(params):
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size={hpz} with AutoEP expert parameters (partitioned over "
                "their expert-data-parallel group) is not supported, as in DeepSpeed; set it to 1"
            )
        if hpz > 1 and self.world_size % hpz:  # refused before any group is made
            raise ValueError(
                f"zero_optimization.zero_hpz_partition_size={hpz} must divide the data-parallel world size "
                f"{self.world_size}"
            )
        self.gather_group = self._new_group()
        self.fp_group = self._new_group(backend="gloo")  # tiny CPU tensors, waited on the CPU with a timeout
        self.secondary = secondary_partition(dp_group, hpz) if hpz > 1 else None
        persistent = self._mark_persistent(module, cfg)
        if self.param_swapper is not None:  # persistent parameters stay whole on every rank: not swapped
            self.param_swapper.adopt([p for p in params if not p.ds_persist], keep=persistent)
        apply_leaf_module_config(module, cfg.leaf_module)  # before the units are cut
        set_leaves_by_granularity(module, cfg.module_granularity_threshold)
        self.coordinator = ParamCoordinator(
            module,
            group=self.gather_group,
            fp_group=self.fp_group,
            prefetch_bucket_size=cfg.prefetch_bucket_size,
            max_live_parameters=cfg.max_live_parameters,
            max_reuse_distance=cfg.max_reuse_distance,
            log_trace_cache_warnings=cfg.log_trace_cache_warnings,
            secondary=self.secondary,
        )
        if persistent:
            self.coordinator.refresh(persistent, "the persistent parameters")
        self._handles = install_hooks(module, self.coordinator)
        for m in module.modules():
            remove_guard(m)
        module._ds_zero3 = self
        logger.info(
            "stage 3: %d parameters partitioned over %d ranks (%d persistent, %d elements)",
            len(params),
            self.world_size,
            len(persistent),
            sum(p.ds_numel for p in persistent),
        )

    def _new_group(self, backend: str | None = None) -> ProcessGroup | None:
        """A group over the data-parallel ranks (parameter gathers and fingerprints each get their own).

        torch needs every rank of the job to create every group, in the same order. When the data-parallel
        group is one of several (tensor parallelism: ranks {0, 2} and {1, 3}), every rank therefore learns
        all of them and creates each in turn, keeping its own.
        """
        if self.world_size == 1:  # nothing is gathered; None would mean the world, which may be larger
            return self.dp_group
        if self.dp_group is None:
            return ds_comm.new_group(None, backend=backend)
        mine = list(torch.distributed.get_process_group_ranks(self.dp_group))
        if len(mine) == ds_comm.get_world_size():
            return ds_comm.new_group(mine, backend=backend)
        everyone: list[Any] = [None] * ds_comm.get_world_size()
        torch.distributed.all_gather_object(everyone, mine)
        own = None
        for ranks in sorted({tuple(r) for r in everyone}):
            group = ds_comm.new_group(list(ranks), backend=backend)
            if ds_comm.get_rank() in ranks:
                own = group
        return own

    @staticmethod
    def _mark_persistent(module: nn.Module, cfg: ZeroConfig) -> list[nn.Parameter]:
        persistent = []
        total = 0
        for p in iter_zero_params(module.parameters()):
            if p.ds_persist:
                continue
            if p.ds_numel < cfg.param_persistence_threshold and total + p.ds_numel <= cfg.model_persistence_threshold:
                p.ds_persist = True
                total += p.ds_numel
                persistent.append(p)
        return persistent

    @property
    def params(self) -> list[nn.Parameter]:
        """Every partitioned parameter of the model, once each, in `named_parameters()` order."""
        return self.coordinator.params

    @property
    def peak_live_numel(self) -> int:
        """Most elements of non-persistent parameters held gathered (or in flight) at once so far."""
        return self.coordinator.live.peak_live_numel

    def reset_peak(self) -> None:
        self.coordinator.live.reset_peak()

    @property
    def num_param_gathers(self) -> int:
        """Parameters all-gathered so far, each gather counted (prefetches and explicit gathers included)."""
        return self.coordinator.live.num_param_gathers

    @property
    def num_block_param_gathers(self) -> int:
        """Of `num_param_gathers`, those served inside the hpZ block from secondary slices (0 without hpZ)."""
        return self.coordinator.live.num_block_param_gathers

    def release_all(self) -> None:
        """Free every gathered parameter no running module or `GatheredParameters` block holds, and the
        released storages kept for reuse (`_params.storage_pool`)."""
        self.coordinator.release_unused()
        released_storages.clear()

    @property
    def forward_hooks(self) -> list[RemovableHandle]:
        """DeepSpeed's name: the handles of the per-module forward hooks (pre and post) that gather and
        release; empty inside `hooks_paused()` (`unwrap_model_for_generation`) and after `remove_hooks()`."""
        return list(self._handles)

    @property
    def backward_hooks(self) -> list[RemovableHandle]:
        """DeepSpeed's name for the module backward hooks; ds registers none (the forward hooks attach the
        backward signals to each call's tensors, see `_schedule.hooks`), so this is always empty."""
        return []

    @contextlib.contextmanager
    def hooks_paused(self) -> Iterator[None]:
        """Inside the block the model runs as a plain module: no gathers or releases around its modules.

        For parameters gathered for the whole block (`GatheredParameters`, `unwrap_model_for_generation`);
        a released parameter read inside stays released (its placeholder holds NaN). The hooks are back
        on exit, exceptions included.
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        try:
            yield
        finally:
            self._handles = install_hooks(self.module, self.coordinator)

    def remove_hooks(self) -> None:
        """Stop scheduling (the parameters stay partitioned)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.module._ds_zero3 = None


def _swapper_of(module: nn.Module) -> ParamSwapper | None:
    """The ParamSwapper holding some of `module`'s shards already (from ds_zero.Init), if any."""
    for p in module.parameters():
        swapper = state_of(p).swap if is_zero_param(p) else None
        if swapper is not None:
            return swapper
    return None
