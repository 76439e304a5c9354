"""`DeepSpeedZeroOptimizer_Stage3`: ZeRO stage 3 around any torch optimizer, with the engine contract's methods."""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_ops import supports_in_pass_copy
from ds_ops.precision import LossScaler, WrappedOptimizer, finish_step, grad_norm_groups
from ds_zero._blocked_adam import step_in_blocks
from ds_zero._coalesce import CoalescedReduction, DeferrableReducer
from ds_zero._construct.quantized_init import refuse_trainable
from ds_zero._host_buffers import release_pinned
from ds_zero._master_dtype import master_weights_dtype
from ds_zero._nvme.eager_step import arm_eager_steps
from ds_zero._nvme.files import prepare_swap_dir, release_swap_dir
from ds_zero._offload_states import OffloadStatesMixin
from ds_zero._param_access import register_owner
from ds_zero._param_names import ParamNames
from ds_zero._params.partitioned_param import ZeroParamStatus, state_of
from ds_zero._params.shards import write_shards
from ds_zero._params.storage_pool import released_storages
from ds_zero._schedule.module import DeepSpeedZeRoOffload
from ds_zero._stage3.arguments import module_and_optimizer
from ds_zero._stage3.build_partitions import build_partitions
from ds_zero._stage3.checkpoint import load_stage3_state_dicts, stage3_state_dict
from ds_zero._stage3.grad_views import GradPartitionViews
from ds_zero._stage3.grads import GradReducer
from ds_zero._stage3.model_parallel import Stage3CutRanges
from ds_zero._stage3.muon import MuonShardUpdate
from ds_zero._stage3.optimizer_swapper import OptimizerSwapper
from ds_zero._stage3.param_access import ShardParamAccess
from ds_zero._stage3.partial_offload import TilePlacement
from ds_zero._stage3.partition import ShardPartition
from ds_zero._stage3.partition_index import PartitionIndex
from ds_zero._stage3.placement_checks import refuse_families, rename_for_checkpoint
from ds_zero._stage3.superoffload import SuperOffload, refuse_superoffload
from ds_zero._zenflow_refusal import refuse_zenflow
from ds_zero._zero_config import as_zero_config

if TYPE_CHECKING:
    from ds_ops.aio import AioConfig
    from ds_zero.config import ZeroConfig

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedZeroOptimizer_Stage3"]


class DeepSpeedZeroOptimizer_Stage3(  # noqa: N801 - DeepSpeed's class name
    ShardParamAccess, GradPartitionViews, OffloadStatesMixin, CoalescedReduction, WrappedOptimizer
):
    """ZeRO stage 3: parameters, gradients and optimizer state all partitioned across the data-parallel ranks.

    Builds (or reuses) the model's `DeepSpeedZeRoOffload`, which partitions the parameters and gathers
    them around each module's forward and backward. Per param group of `optimizer`, this rank's shards
    of the group's parameters form one flat fp32 master partition (on the host with
    `offload_optimizer.device="cpu"`); the base optimizer is re-pointed at those partitions, so its state
    is 1/N too. Gradients are reduce-scattered into the masters' `.grad` during backward.

    `step()`: `ds_ops.precision.finish_step` on the fp32 gradient partitions (unscale, inf/nan check,
    loss-scaler update, global norm, clip; one all-reduce, so an inf/nan on any rank skips the step on
    all ranks), for `use_muon` groups (`ds_ops.MuonWithAuxAdam`) the Muon update of the whole matrices
    (`_stage3.muon`), the base optimizer's step on the partitions, copy into the model-dtype shards, and
    re-gather the parameters that stay whole (persistent ones).

    One parameter's fp32 master, gradient and optimizer state are read and written with DeepSpeed's
    per-parameter methods (`get_full_hp_param`, `get_local_fp32_param`, `get_fp32_grad_for_param`, ...;
    `ds_zero._stage3.param_access`), which `deepspeed.utils.safe_get_full_fp32_param` and friends call.

    Called as `DeepSpeedZeroOptimizer_Stage3(module, optimizer, config=...)` (DeepSpeed's order) or, like
    the stage 1/2 optimizer in the engine contract, `DeepSpeedZeroOptimizer_Stage3(optimizer, module=...,
    config=...)`.

    Args:
        module: the model (built normally or under `ds_zero.Init`).
        optimizer: a torch optimizer built over the model's parameters, not stepped yet.
        config: the `zero_optimization` section (stage must be 3).
        loss_scaler: ds_ops loss scaler (None: static 1.0; fp16 passes a DynamicLossScaler).
        clip_grad: clip by the global gradient norm (0: off).
        check_overflow: skip steps whose gradients hold inf/nan on any rank (fp16 always; the engine
            passes `bf16.check_grad_overflow` for bf16). Off, such a step is applied as it is.
        dp_group: the data-parallel group (None: the world).
        gradient_predivide_factor: divide gradients by this before the reduction (and by N/factor after).
        communication_dtype: dtype of the gradient reduce-scatter (None: the gradients' dtype).
        parameter_offload: an existing `DeepSpeedZeRoOffload` of `module` (default: the module's, or a new one).
        aio_config: the top-level `aio` section (dict or `ds_ops.AioConfig`) used by NVMe offload (None: defaults).
        model_parallel_group: the tensor-parallel group whose ranks hold other shards of the same model (AutoTP);
            the norm and the overflow flag then span it (`_stage3.model_parallel`).
        model_parallel_params: with `model_parallel_group`, the parameters cut across it; every other
            parameter is replicated there and counted once in the norm.
        bf16_master_weights_and_gradients: keep the master and gradient partitions in bf16
            (`bf16.bf16_master_weights_and_grads`; see `ds_zero._master_dtype`).
        bf16_optimizer_states: the base optimizer's state follows the bf16 masters (`bf16.bf16_optimizer_states`;
            needs `bf16_master_weights_and_gradients`).
        fp16_master_weights_and_gradients: fp16 masters and gradient partitions on the host, fp32 moments in
            DeepSpeedCPUAdam (`fp16.fp16_master_weights_and_grads`; CPU optimizer offload only).
        checkpoint_names: module parameter name -> the name its fragments are saved under (an AutoEP expert
            tensor's name with its expert range, so that different expert-parallel ranks' experts never meet
            in one consolidated tensor); the gather fingerprints keep the module names.

    Parameters of a placement family (AutoEP experts, marked before partitioning; `ds_zero._params.placement`)
    are partitioned, gathered and reduce-scattered over their family's group and averaged over `dp_group`.

    With `offload_optimizer.device="nvme"` the fp32 master and the optimizer state of each tile live in swap
    files under `nvme_path` and are swapped in and out around the step, tile by tile (`sub_group_size`),
    overlapping the next read / previous write with `pipeline_read` / `pipeline_write`; the fp32 gradient
    partition stays in host memory. See `ds_zero._nvme.optimizer_swapper`.

    Raises:
        TypeError: not exactly one module and one optimizer given.
        ValueError: stage is not 3, a refused bf16-master combination (`ds_zero._master_dtype`), the optimizer
            was already stepped, Muon groups with NVMe optimizer offload or holding a parameter of fewer
            than 2 dims, an optimizer parameter is not in `module` or is a trainable quantized weight
            (`weight_quantization.quantized_initialization`), or
            (NVMe offload) `nvme_path` is missing or not writable.
        NVMeSwapError: a swap file could not be written or read back intact, at construction or at the step
            where it happens (disk full, file-size limit, truncated or corrupted file).
    """

    def __init__(
        self,
        *args: nn.Module | torch.optim.Optimizer,
        module: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        config: ZeroConfig | Mapping[str, Any] | None = None,
        loss_scaler: LossScaler | None = None,
        clip_grad: float = 0.0,
        check_overflow: bool = True,
        dp_group: ProcessGroup | None = None,
        gradient_predivide_factor: float = 1.0,
        communication_dtype: torch.dtype | None = None,
        parameter_offload: DeepSpeedZeRoOffload | None = None,
        aio_config: Mapping[str, Any] | AioConfig | None = None,
        model_parallel_group: ProcessGroup | None = None,
        model_parallel_params: Collection[torch.Tensor] = (),
        bf16_master_weights_and_gradients: bool = False,
        bf16_optimizer_states: bool = False,
        fp16_master_weights_and_gradients: bool = False,
        checkpoint_names: Mapping[str, str] | None = None,
    ) -> None:
        module, optimizer = module_and_optimizer(args, module, optimizer)
        cfg = as_zero_config(config)
        if cfg.stage != 3:
            raise ValueError(
                f"DeepSpeedZeroOptimizer_Stage3 needs zero_optimization.stage=3, got {cfg.stage}; use "
                "ds_zero.DeepSpeedZeroOptimizer for stages 1 and 2"
            )
        if not self._runs_zenflow:
            refuse_zenflow(cfg)
        self.master_weights_and_grads_dtype = master_weights_dtype(
            bf16_master_weights_and_gradients=bf16_master_weights_and_gradients,
            bf16_optimizer_states=bf16_optimizer_states,
            offload_device=cfg.offload_optimizer_device,
            optimizer=optimizer,
            fp16_master_weights_and_gradients=fp16_master_weights_and_gradients,
        )
        if optimizer.state:
            raise ValueError(
                "the base optimizer already has state (it was stepped); build "
                "DeepSpeedZeroOptimizer_Stage3 around a fresh optimizer"
            )
        if cfg.offload_optimizer_device == "nvme" and any(g.get("use_muon", False) for g in optimizer.param_groups):
            raise ValueError(
                "Muon (param groups with use_muon=True) with zero_optimization.offload_optimizer.device=nvme is "
                "not supported in ds: the Muon update gathers each matrix's gradient and momentum, which the NVMe "
                "step keeps on disk; use offload_optimizer.device 'cpu' or 'none'"
            )
        refuse_trainable(p for g in optimizer.param_groups for p in g["params"])
        refuse_superoffload(optimizer, cfg)
        if model_parallel_group is not None and cfg.offload_optimizer_device == "nvme":
            raise ValueError(
                "zero_optimization.offload_optimizer.device=nvme is not supported with tensor parallelism "
                "(tensor_parallel.autotp_size > 1) in ds: the NVMe step measures the gradient norm from per-tile "
                "sums that cannot leave the replicated parameters' duplicates out; use device 'cpu' or 'none'"
            )
        if gradient_predivide_factor <= 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
        self.config = cfg
        self.module = module
        self.optimizer = optimizer
        self.dp_group = dp_group
        self.loss_scaler = loss_scaler if loss_scaler is not None else LossScaler(1.0)
        self.clip_grad = float(clip_grad)
        self.check_overflow = bool(check_overflow)
        nvme = cfg.offload_optimizer_device == "nvme"
        # checked before anything is partitioned or re-pointed
        swap_dir = (
            prepare_swap_dir(
                cfg.offload_optimizer_or_default.nvme_path,
                rank=ds_comm.get_rank(),
                kind="optimizer",
                key="zero_optimization.offload_optimizer.nvme_path",
            )
            if nvme
            else None
        )
        try:
            self.parameter_offload = (
                parameter_offload
                or getattr(module, "_ds_zero3", None)
                or DeepSpeedZeRoOffload(module, config=cfg, dp_group=dp_group, aio_config=aio_config)
            )
        except BaseException:
            if swap_dir is not None:
                release_swap_dir(swap_dir)
            raise
        self.coordinator = self.parameter_offload.coordinator
        refuse_families(self.coordinator.params, optimizer, model_parallel_group)
        rename_for_checkpoint(module, checkpoint_names)
        self.world_size = ds_comm.get_world_size(dp_group)
        self.dp_rank = ds_comm.get_rank(dp_group)
        self.offload_optimizer = cfg.offload_optimizer_device in ("cpu", "nvme")
        # this optimizer's per-parameter bookkeeping (master slice, gradient bucket and slot)
        self.partition_index = PartitionIndex()
        self._placement = TilePlacement(optimizer, cfg, model_parallel=model_parallel_group is not None)
        self.partitions = build_partitions(self, swap_master=nvme)
        self.model_parallel_group = model_parallel_group
        self._cut = (
            Stage3CutRanges(self.partitions, model_parallel_params) if model_parallel_group is not None else None
        )
        self.optimizer_swapper = (
            OptimizerSwapper(
                self.tiles,
                optimizer,
                index=self.partition_index,
                swap_dir=swap_dir,
                config=cfg.offload_optimizer_or_default,
                aio_config=aio_config,
            )
            if swap_dir is not None
            else None
        )
        trained = [p for part in self.partitions for p in part.params]
        trained_ids = {id(p) for p in trained}
        self.frozen = ShardPartition(
            -1, [p for p in self.coordinator.params if not p.requires_grad], master_device=None, with_master=False
        )
        untrained = [p for p in self.coordinator.params if p.requires_grad and id(p) not in trained_ids]
        if untrained:
            logger.warning(
                "stage 3: %d trainable parameters of the module are not in the optimizer (first: %s); "
                "their gradients are not reduced",
                len(untrained),
                state_of(untrained[0]).name,
            )
        ordered = [p for p in self.coordinator.params if id(p) in trained_ids]
        swapper = self.optimizer_swapper
        self.reducer = GradReducer(
            ordered,
            partition_index=self.partition_index,
            group=dp_group,
            reduce_bucket_size=cfg.reduce_bucket_size,
            communication_dtype=communication_dtype,
            gradient_predivide_factor=gradient_predivide_factor,
            on_first_grad=self.coordinator.ensure_backward,
            swapped={id(p): (t, off) for t in self.tiles for p, off in zip(t.params, t.offsets, strict=True)}
            if swapper is not None
            else None,
            grad_swapper=swapper.grads if swapper is not None else None,
            overlap_comm=cfg.overlap_comm,
        )
        self.coordinator.end_of_backward_callbacks.append(self.reducer.finish)
        self._trained = trained
        register_owner(trained, self)
        self._global_grad_norm = None
        self._boundary_hint = False
        self._window_continues = False  # set only by set_step_boundary(False): see the coordinator's carry
        #: NVMe optimizer: update sub-groups during the boundary backward, speculatively (False: at `step()`)
        self.nvme_speculation = True
        self._last_step_clean = True
        self.overflow = False
        self._fused_copy = supports_in_pass_copy(optimizer)
        nccl = ds_comm.is_initialized() and torch.distributed.get_backend(dp_group) == "nccl"
        self._norm_device = ds_comm.get_accelerator().device() if nccl else torch.device("cpu")
        names = ParamNames(module)
        # what ds_zero.save_zero_checkpoint and the engine read (same names as the stage 1/2 optimizer)
        self.zero_stage = 3
        self.dp_world_size = self.world_size
        self.shared_params = names.shared_params()
        self.frozen_param_shapes = {state_of(p).name: list(p.ds_shape) for p in self.frozen.params}
        self.flats = self.partitions
        muon = MuonShardUpdate(
            optimizer,
            self.partitions,
            dp_group,
            bucket_numel=cfg.reduce_bucket_size,
            comm_device=self._norm_device if nccl else None,
        )
        self._muon = muon if muon.partitions else None
        self._super = self._superoffload(cfg)

    #: Whether this class runs ZenFlow's loop (`ds_zero._zenflow.ZenFlowZeroOptimizer_Stage3`); this one refuses
    #: the section.
    _runs_zenflow = False

    def _superoffload(self, cfg: ZeroConfig) -> SuperOffload | None:
        """`offload_optimizer.super_offload`: the CPU tiles step during backward (`_stage3.superoffload`)."""
        off = cfg.offload_optimizer_or_default
        if not off.super_offload:
            return None
        sup = SuperOffload(self, self._placement.cpu_tiles, cores_perc=off.cpuadam_cores_perc)
        self.reducer.on_piece = sup.on_piece
        return sup

    @property
    def tiles(self) -> list[Any]:
        """The base optimizer's parameters, in order: the tiles of every group's partition."""
        return [tile for part in self.partitions for tile in part.tiles]

    @property
    def fp16_groups(self) -> list[list[nn.Parameter]]:
        """DeepSpeed's name: the model parameters of each sub-group (tile), in the base optimizer's order."""
        return [list(tile.params) for tile in self.tiles]

    @property
    def fp32_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's name: each sub-group's flat fp32 master slice, the base optimizer's parameter (its
        `optimizer.state` key; a NaN placeholder while swapped to NVMe)."""
        return [tile.master for tile in self.tiles]

    @property
    def fp16_partitioned_groups_flat(self) -> list[torch.Tensor]:
        """DeepSpeed's name: each sub-group's flat model-dtype shards; a copy (read it, write the parameters)."""
        return [tile.model_values() for tile in self.tiles]

    def sub_group_param_shapes(self) -> list[dict[str, list[int]]]:
        """Per sub-group (tile, in the base optimizer's order): name -> full shape of its parameters."""
        return [tile.param_shapes() for tile in self.tiles]

    def _set_fp32_optimizer_param_groups(self) -> None:
        """Point the base optimizer's param groups at every sub-group's fp32 partition (DeepSpeed's name).

        DeepSpeed keeps those groups empty between steps and fills them around `step()` and around a
        read of `optimizer.optimizer.state_dict()`. ds keeps them filled at all times, so this only
        re-establishes that (after a caller emptied or replaced a group's `params`).
        """
        for gi, masters in self._placement.masters_by_group(self.partitions).items():
            self.optimizer.param_groups[gi]["params"] = masters

    def _clear_fp32_optimizer_param_groups(self) -> None:
        """DeepSpeed's counterpart of `_set_fp32_optimizer_param_groups`. ds's resting state is the filled
        groups (its `step()` steps whatever they hold), so this restores that state rather than emptying them."""
        self._set_fp32_optimizer_param_groups()

    # ------------------------------------------------------------------------------ the contract
    # param_groups, state, defaults, loss_scale, cur_scale, global_grad_norm: `WrappedOptimizer`
    def _get_norm_groups(self) -> list[torch.Tensor]:
        """The L2 norm of each param group's current gradient, over all ranks (DeepSpeed's name); a collective.

        Reads the reduced gradient partitions of this accumulation window as they are held, before
        `step()` unscales or clips them: still multiplied by the loss scale under fp16 (as DeepSpeed's are;
        `_global_grad_norm` after the step is unscaled), and including any `safe_set_local_grad` edits.
        Measured as `step()` measures them (`ds_ops.precision.grad_norm_groups`), so the norm of these norms
        is the step's global norm times the loss scale. With the optimizer on NVMe the per-tile terms
        recorded as the gradients were written are used.

        Returns:
            One 0-dim fp32 tensor per param group of the base optimizer (0 for a group without gradients),
            on the device the step's norm is reduced on. One all-reduce over the data-parallel group.
        """
        swapper = self.optimizer_swapper
        if swapper is not None:
            stats = [swapper.grads.stats(part.tiles) for part in self.partitions]
            return grad_norm_groups(stats=stats, group=self.dp_group, comm_device=self._norm_device)
        grads = [part.master.grad for part in self.partitions]
        return grad_norm_groups(
            self._placement.grads_by_group(self.partitions),
            group=self.dp_group,
            comm_device=self._norm_device,
            model_parallel_group=self.model_parallel_group,
            model_parallel_grads=self._cut.group_views(grads) if self._cut is not None else None,
        )

    def set_step_boundary(self, is_boundary: bool) -> None:
        """The engine says whether the next backward ends the gradient accumulation window (the next
        `step()` updates). Only then may NVMe-swapped sub-groups be updated during that backward; otherwise
        parameters the next forward needs soon may stay gathered ([Note: carried into the next micro-step])."""
        self._boundary_hint = bool(is_boundary)
        self._window_continues = not is_boundary

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """`(loss * loss_scale).backward()`; gradients are reduce-scattered as backward produces them."""
        # parameters the next micro-step's forward needs soon may stay gathered (its shards do not change)
        self.coordinator.carry_into_next, self._window_continues = self._window_continues, False
        if self._super is not None:
            self._super.arm(self._boundary_hint)
        self._boundary_hint = arm_eager_steps(self, self._boundary_hint)
        self.loss_scaler.scale_loss(loss).backward(retain_graph=retain_graph)

    def _deferrable_reducer(self) -> DeferrableReducer:
        return self.reducer

    def step(self, closure: Callable[[], Any] | None = None, *, skip: torch.Tensor | None = None) -> bool:
        """Apply one optimizer step on the partitions; returns False when skipped (overflow on any rank).

        `skip` is a 1-element flag already agreed across the ranks that must skip together; non-zero
        skips this step as an overflow does.
        """
        if closure is not None:
            raise ValueError("DeepSpeedZeroOptimizer_Stage3.step() does not take a closure")
        self._refuse_step_while_coalescing()
        self.reducer.finish()
        if self._super is not None:
            self._super.wait()
        all_grads = [part.master.grad for part in self.partitions]
        grads = [g for g in all_grads if g is not None]
        swapper = self.optimizer_swapper
        outcome = finish_step(
            grads,
            scaler=self.loss_scaler,
            clip=self.clip_grad,
            check_overflow=self.check_overflow,
            compute_norm=True,
            group=self.dp_group,
            partitioned=True,
            comm_device=self._norm_device,
            skip=skip,
            stats=swapper.grads.stats() if swapper is not None else None,  # NVMe: the gradients are on disk
            model_parallel_group=self.model_parallel_group,
            model_parallel_grads=self._cut.views(all_grads) if self._cut is not None else None,
        )
        if swapper is not None:
            swapper.grad_outcome = outcome
            self._last_step_clean = outcome.applied and outcome.clip_coef == 1.0
            if swapper.grads.eager is not None:  # keep or undo the updates made during backward
                swapper.grads.eager.settle(outcome)
        if self._super is not None:  # keep, undo or redo the updates made during backward
            self._super.settle(outcome)
        if not self._record_outcome(outcome):
            return False
        if self._muon is not None:  # after unscale, check and clip: `_stage3.muon`
            self._muon()
        self._base_step()
        self.refresh_gathered()
        return True

    def _step_one(self, tile: Any) -> None:
        """Step the base optimizer on one bound tile (its group narrowed to it) and write its 16-bit shards."""
        groups = self.optimizer.param_groups
        saved = [group["params"] for group in groups]
        try:
            for gi, group in enumerate(groups):
                group["params"] = [tile.master] if gi == tile.group_index else []
            self._step_tiles([tile])
        finally:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params

    def _base_step(self) -> None:
        tiles = self.tiles
        eager = self.optimizer_swapper.grads.eager if self.optimizer_swapper is not None else None
        if eager is not None:  # stepped during backward: not again
            tiles = [t for t in tiles if t.index not in eager.stepped]
        if self._super is not None and self._super.done:  # SuperOffload kept its in-backward updates
            tiles = [t for t in tiles if id(t) not in self._super.done]
        for tile in tiles:
            tile.attach_grad()
        if len(tiles) == len(self.partitions) and self.optimizer_swapper is None and not self._placement.partial:
            self._step_tiles(tiles)
        else:  # one tile at a time, so the step's temporaries stay within sub_group_size
            groups = self.optimizer.param_groups
            saved = [group["params"] for group in groups]
            swapper = self.optimizer_swapper
            order = tiles if swapper is None else swapper.swapped_in(tiles)  # NVMe: read / step / write
            try:
                for tile in order:
                    for gi, group in enumerate(groups):
                        group["params"] = [tile.master] if gi == tile.group_index else []
                    self._step_tiles([tile])
            finally:
                if swapper is not None:
                    order.close()  # settles any request still in flight after an error
                for group, params in zip(groups, saved, strict=True):
                    group["params"] = params
        for tile in tiles:
            tile.master.grad = None
        swapper = getattr(self.parameter_offload, "param_swapper", None)
        if swapper is not None:  # the new 16-bit shards' writes overlapped the next tiles; a failure shows here
            swapper.settle()

    def _step_tiles(self, tiles: list[Any]) -> None:
        """Step the base optimizer (whose groups hold exactly `tiles`) and update the model-dtype shards."""
        optimizer = self._placement.optimizer_for(tiles)  # partial offload: the device twin for device tiles
        fused = (
            self._fused_copy
            and optimizer is self.optimizer
            and all(t.shard16() is not None and not t.partition.master_is_shard for t in tiles)
        )
        if fused:  # ds_ops CPU optimizers write the 16-bit shards in the same pass
            by_group: list[list[torch.Tensor]] = [[] for _ in self.optimizer.param_groups]
            for tile in tiles:
                by_group[tile.group_index].append(tile.shard16())
            self.optimizer.step(fp16_param_groups=by_group)
            return
        if not step_in_blocks(optimizer):  # a client's torch Adam/AdamW: the same bits, in cache-sized blocks
            optimizer.step()
        for tile in tiles:
            if not tile.partition.master_is_shard:
                with torch.no_grad():
                    if tile.shard16() is not None:
                        tile.shard16().copy_(tile.master)
                    else:  # shards one by one (NVMe-swapped ones are written to their files)
                        write_shards(
                            tile.params,
                            [
                                tile.master[off : off + state_of(p).shard_numel]
                                for p, off in zip(tile.params, tile.offsets, strict=True)
                            ],
                        )

    def refresh_gathered(self, include_frozen: bool = False) -> None:
        """Re-gather the parameters that stay whole after their shards changed; free the other gathered ones."""
        self.coordinator.release_unused()
        params = [*self._trained, *self.frozen.params] if include_frozen else self._trained
        stale = [p for p in params if p.ds_status is ZeroParamStatus.AVAILABLE]
        self.coordinator.refresh(stale, "the whole parameters updated by the optimizer step")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradient partitions (and any full gradient still on a parameter)."""
        self.reducer.discard()
        if self._super is not None:  # updates made from gradients that no step will use
            self._super.discard()
        if self.optimizer_swapper is not None:
            self.optimizer_swapper.grads.zero_grad()
        for part in self.partitions:
            if set_to_none:  # frees them: what a caller asks for before evaluation or generation
                part.master.grad = None
            elif part.master.grad is not None:
                part.master.grad.zero_()
        for p in self.coordinator.params:
            p.grad = None

    def refresh_fp32_params(self) -> None:
        """Reload the fp32 masters from the model-dtype shards (after the module's weights were loaded or
        edited outside the optimizer), and re-gather the parameters that stay whole."""
        for part in self.partitions:
            part.copy_shards_to_master()
        self.refresh_gathered(include_frozen=True)

    _restore_from_bit16_weights = refresh_fp32_params  # DeepSpeed's name, used by ds-engine

    # ------------------------------------------------------------------------------ checkpoints
    def base_optimizer_state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict, with NVMe-swapped state read back into memory."""
        if self.optimizer_swapper is not None:
            return self.optimizer_swapper.state_dict()
        return self.optimizer.state_dict()

    def state_dict(self) -> dict[str, Any]:
        """THIS rank's partitions and metadata in the shared ZeRO checkpoint format (`_checkpoint.format`)."""
        return stage3_state_dict(self)

    def load_state_dict(
        self,
        state_dicts: list[Mapping[str, Any]] | Mapping[str, Any],
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = True,
    ) -> None:
        """Restore from ALL saved ranks' state dicts (rank order), saved at any world size and any ZeRO stage."""
        load_stage3_state_dicts(
            self,
            state_dicts,
            load_optimizer_states=load_optimizer_states,
            load_from_fp32_weights=load_from_fp32_weights,
        )
        self.refresh_gathered(include_frozen=True)

    def destroy(self) -> None:
        """Remove the gradient hooks and free the fp32 masters pinned by the native backend
        (DS_PIN_MEMORY_BACKEND=native). The optimizer must not be used afterwards.

        Parameter shards pinned for `offload_param` stay: they belong to the module, which outlives the
        optimizer, and are freed with it.
        """
        self.reducer.remove()
        released_storages.clear()  # the gathers' pooled memory (`_params.storage_pool`)
        if self._super is not None:
            self._super.close()
        if self.offload_optimizer:
            release_pinned(part.master for part in self.partitions if part.master is not None)
