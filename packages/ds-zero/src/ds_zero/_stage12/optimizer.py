"""`DeepSpeedZeroOptimizer`: ZeRO stages 1 and 2 around any torch optimizer."""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed import ProcessGroup

import ds_comm
from ds_ops.precision import LossScaler, StepOutcome, WrappedOptimizer, finish_step, grad_norm_groups
from ds_zero._checkpoint.format import FragmentIndex
from ds_zero._coalesce import CoalescedReduction, DeferrableReducer
from ds_zero._host_buffers import release_pinned
from ds_zero._master_dtype import master_weights_dtype, note_master_conversion
from ds_zero._offload_states import OffloadStatesMixin
from ds_zero._param_access import register_owner
from ds_zero._param_names import ParamNames
from ds_zero._stage12.allgather import PartitionAllGather
from ds_zero._stage12.buckets import BucketReducer
from ds_zero._stage12.deepspeed_views import NCCL_START_ALIGNMENT_FACTOR, FlatBufferViews
from ds_zero._stage12.flat_buffer import FlatParamGroup
from ds_zero._stage12.model_parallel import CutRanges
from ds_zero._stage12.muon import MuonPartitionUpdate
from ds_zero._stage12.pair_memory import share_for
from ds_zero._stage12.param_access import PartitionParamAccess
from ds_zero._stage12.partitions import PartitionUpdater, build_grad_partitions, build_master_partitions
from ds_zero._stage12.reduce import BoundaryReducer, RangeReducer
from ds_zero._stage12.state import (
    as_state_dict_list,
    build_rank_state_dict,
    load_base_optimizer_state,
    load_masters,
)
from ds_zero._stage12.universal_info import UNIVERSAL_INFO_KEY, UniversalInfoCache
from ds_zero._zenflow_refusal import refuse_zenflow

if TYPE_CHECKING:
    from ds_zero.config import ZeroConfig

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedZeroOptimizer", "ZeroOptimizer"]


class DeepSpeedZeroOptimizer(
    PartitionParamAccess,
    FlatBufferViews,
    OffloadStatesMixin,
    CoalescedReduction,
    UniversalInfoCache,
    WrappedOptimizer,
    torch.optim.Optimizer,
):
    """ZeRO stage 1 or 2: optimizer state (and at stage 2 gradients) partitioned across data-parallel ranks.

    At construction, per param group of `optimizer`, the trainable parameters are copied into one flat
    buffer of the model dtype, padded to a multiple of the world size, and become views of it (frozen
    parameters, `requires_grad=False`, are left alone). Rank r owns the contiguous partition r. It keeps
    the fp32 master values (a view of the flat buffer for fp32 without offload, no copy) and the base
    optimizer's state for that partition only: the base optimizer's k-th group is re-pointed to
    `[master partition k]`, so its hyper-parameters (`param_groups[k]["lr"]`) stay live. The parameters
    are then all-gathered once so every rank starts from the same values.

    Backward: stage 1 lets gradients accumulate in a flat buffer per group (each `.grad` is a view of it)
    and reduces them to their owners at `step()`. Stage 2 reduces them during backward from
    per-parameter hooks in `reduce_bucket_size` buckets (asynchronously with `overlap_comm`), accumulates
    each micro-step into this rank's fp32 gradient partition and frees the full gradients at once.

    `step()`: finish the reduction, then `ds_ops.precision.finish_step` on this rank's fp32 gradient
    partitions (unscale, inf/nan check, loss-scaler update, the global norm over all partitions, clip; the
    flag and the partial norm share one all-reduce), so an inf/nan on any rank skips the step on every
    rank; else (groups flagged `use_muon` first get their slice of the Muon update of the whole matrices,
    see `_stage12/muon.py`) step the base optimizer on the partition, write it back in the model dtype and all-gather
    the updated partitions into every rank's parameters in `allgather_bucket_size` chunks.

    One parameter's fp32 master, gradient and optimizer state are read and written with DeepSpeed's
    per-parameter methods (`get_full_hp_param`, `get_fp32_grad_for_param`, ...; `ds_zero._stage12.param_access`),
    which `deepspeed.utils.safe_get_full_fp32_param` and friends call.

    Args:
        optimizer: base optimizer built over the model's (already dtype-cast) parameters. Its per-element
            math must not depend on the tensor layout (Adam, AdamW, SGD, Adagrad, Lion: yes; LAMB's
            per-tensor trust ratio: no). With offload it runs on host tensors (ds_ops DeepSpeedCPUAdam).
        config: the `zero_optimization` section; `stage` must be 1 or 2.
        module: the model, for parameter names in checkpoints (`zero_to_fp32` needs them); without it the
            names are `group{g}.param{i}`.
        loss_scaler: ds_ops loss scaler; None means a static scale of 1 (fp32/bf16). fp16 passes a
            `DynamicLossScaler`.
        clip_grad: clip gradients to this global L2 norm (0: off).
        check_overflow: skip steps whose gradients hold inf/nan on any rank (fp16 always; the engine
            passes `bf16.check_grad_overflow` for bf16). Off, such a step is applied as it is.
        dp_group: the data-parallel process group (None: the world).
        gradient_predivide_factor: divide gradients by this before the reduction and by
            `world / factor` after.
        gradient_average: average the ranks' gradients (True, `gradient_allreduce_op: "mean"`) or keep
            their sum (False, `"sum"`: no division, `gradient_predivide_factor` ignored).
        communication_dtype: dtype the gradients are reduced in (None: the model dtype).
        partition_groups: per param group of `optimizer`, the process group its parameters are replicated
            over, so partitioned and reduced over (None or a None entry: `dp_group`). It must lie inside
            `dp_group`, and every rank of `dp_group` must hold a group of the same shape there. Gradients
            are still averaged over `dp_group`'s size. Mixture-of-experts models give their expert param
            groups the expert-data-parallel group: each expert lives on the ranks of one such group, and
            tokens of every data-parallel rank reach it. The global norm and the overflow check still
            reduce over `dp_group`, which counts every partition of every group once.
        checkpoint_names: module parameter name -> the name to save it under (an expert's global name,
            so that saves at one expert-parallel degree load at another).
        model_parallel_group: the tensor-parallel group, whose ranks hold other shards of the same model
            (None: no model parallelism). The global norm and the overflow flag are then also combined
            over it (`ds_ops.precision.finish_step`), so every shard clips by the whole model's norm and
            skips the same steps. Every rank of it must step together.
        model_parallel_params: with `model_parallel_group`, the parameters cut across it (each rank holds
            a different shard); the others are replicated on it and counted once in the norm.
        bf16_master_weights_and_gradients: keep the master partitions and the gradient partitions in bf16
            (`bf16.bf16_master_weights_and_grads`; see `ds_zero._master_dtype`).
        bf16_optimizer_states: the base optimizer's state follows the bf16 masters (`bf16.bf16_optimizer_states`;
            needs `bf16_master_weights_and_gradients`).
        fp16_master_weights_and_gradients: fp16 masters and gradient partitions on the host, fp32 moments in
            DeepSpeedCPUAdam (`fp16.fp16_master_weights_and_grads`; CPU optimizer offload only).

    Raises:
        ValueError: stage not 1/2, nvme offload, a refused bf16-master combination (`ds_zero._master_dtype`),
            a negative clip value or predivide factor, an odd `allgather_bucket_size` (a `ds_comm.UsageError`,
            also an AssertionError as DeepSpeed asserts it).
        TypeError: `optimizer` is not a torch optimizer, or a group mixes dtypes/devices.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        config: ZeroConfig,
        module: torch.nn.Module | None = None,
        loss_scaler: LossScaler | None = None,
        clip_grad: float = 0.0,
        check_overflow: bool = True,
        dp_group: ProcessGroup | None = None,
        gradient_predivide_factor: float = 1.0,
        gradient_average: bool = True,
        communication_dtype: torch.dtype | None = None,
        partition_groups: Sequence[ProcessGroup | None] | None = None,
        checkpoint_names: Mapping[str, str] | None = None,
        model_parallel_group: ProcessGroup | None = None,
        model_parallel_params: Collection[torch.Tensor] = (),
        bf16_master_weights_and_gradients: bool = False,
        bf16_optimizer_states: bool = False,
        fp16_master_weights_and_gradients: bool = False,
    ) -> None:
        _check_arguments(optimizer, config, clip_grad, gradient_predivide_factor, zenflow=self._runs_zenflow)
        self.master_weights_and_grads_dtype = master_weights_dtype(
            bf16_master_weights_and_gradients=bf16_master_weights_and_gradients,
            bf16_optimizer_states=bf16_optimizer_states,
            offload_device=config.offload_optimizer_device,
            optimizer=optimizer,
            fp16_master_weights_and_gradients=fp16_master_weights_and_gradients,
        )
        if partition_groups is not None and len(partition_groups) != len(optimizer.param_groups):
            raise ValueError(
                f"partition_groups has {len(partition_groups)} entries but the optimizer has "
                f"{len(optimizer.param_groups)} param groups; give one process group (or None) per group"
            )
        self.optimizer = optimizer
        self.zero_stage = int(config.stage)
        self.dp_group = dp_group
        self.dp_world_size = ds_comm.get_world_size(dp_group)
        self.dp_rank = ds_comm.get_rank(dp_group)
        self.gradient_average = bool(gradient_average)
        self.loss_scaler = loss_scaler if loss_scaler is not None else LossScaler(1.0)
        self.clip_grad = float(clip_grad)
        self.check_overflow = bool(check_overflow)
        self.offload = config.offload_optimizer_device == "cpu"
        self.overflow = False
        self._global_grad_norm = None

        names = ParamNames(module, renames=checkpoint_names)
        self.partition_groups: list[ProcessGroup | None] = [
            dp_group if partition_groups is None or partition_groups[g] is None else partition_groups[g]
            for g in range(len(optimizer.param_groups))
        ]
        self.flats = [self._flatten_group(g, group, names) for g, group in enumerate(optimizer.param_groups)]
        self.bit16_groups = [list(f.params) for f in self.flats]
        self._enable_universal_checkpoint()
        # The overflow check does not need the norm (finish_step checks on its own), so the norm is taken
        # only when asked for or needed to clip.
        self._compute_norm = config.compute_grad_norm or self.clip_grad > 0
        self.model_parallel_group = model_parallel_group
        self._cut = CutRanges(self.flats, model_parallel_params) if model_parallel_group is not None else None
        self.shared_params = names.shared_params()
        self.frozen_param_shapes = names.frozen_param_shapes()
        pin = config.offload_optimizer_or_default.pin_memory
        master_dtype = self.master_weights_and_grads_dtype
        self.masters = build_master_partitions(self.flats, offload=self.offload, pin_memory=pin, dtype=master_dtype)
        by_group: dict[int, RangeReducer] = {}
        for pg in self.partition_groups:
            if id(pg) not in by_group:
                by_group[id(pg)] = RangeReducer(
                    pg,
                    use_reduce_scatter=config.reduce_scatter,
                    predivide_factor=gradient_predivide_factor,
                    average_world=self.dp_world_size,
                    average=gradient_average,
                )
        reducers = [by_group[id(pg)] for pg in self.partition_groups]
        self._grads = self._build_reduction(config, reducers, communication_dtype, pin)
        self.grad_partitions: list[torch.Tensor] = self._grads.accumulators
        self._partitions_clear = False  # zero_grad() cleared them and nothing wrote them since
        self._adopt_base_optimizer()
        self._updater = PartitionUpdater(optimizer, self.flats, self.masters, offload=self.offload)
        self._comm_device = next((f.device for f in self.flats if f.numel), torch.device("cpu"))
        muon = MuonPartitionUpdate(optimizer, self.flats, self.masters, dp_group, self._comm_device)
        self._muon = muon if muon.active else None
        self._sync = PartitionAllGather(
            self.flats,
            self.partition_groups,
            bucket_numel=config.allgather_bucket_size,
            allgather_partitions=config.allgather_partitions,
        )
        self._sync()
        register_owner([p for f in self.flats for p in f.params], self)
        logger.info(
            "ZeRO stage %d: %d group(s), %d trainable elements, partition %s elements/rank on %d ranks%s",
            self.zero_stage,
            len(self.flats),
            sum(f.numel for f in self.flats),
            [f.partition_numel for f in self.flats],
            self.dp_world_size,
            ", optimizer offloaded to cpu" if self.offload else "",
        )

    # ----- construction helpers -------------------------------------------------------------------
    def _flatten_group(self, g: int, group: dict[str, Any], names: ParamNames) -> FlatParamGroup:
        trainable, seen = [], set()
        for i, p in enumerate(group["params"]):
            if id(p) in seen:
                continue
            seen.add(id(p))
            if p.requires_grad:
                trainable.append((p, names.name_of(p, g, i)))
            else:
                names.note_frozen(p, g, i)
        pg = self.partition_groups[g]
        trained = [p for p, _ in trainable]
        world, rank = ds_comm.get_world_size(pg), ds_comm.get_rank(pg)
        share = None if self._runs_zenflow else share_for(pg)  # ZenFlow swaps the flat buffers it updates
        return FlatParamGroup(trained, [n for _, n in trainable], world, rank, share=share)

    def _build_reduction(
        self,
        config: ZeroConfig,
        reducers: list[RangeReducer],
        communication_dtype: torch.dtype | None,
        pin: bool,
    ) -> BoundaryReducer | BucketReducer:
        share = [share_for(pg) for pg in self.partition_groups]  # two ranks of one host: pair memory
        if self.zero_stage == 1:
            master_dtype = self.master_weights_and_grads_dtype
            in_place = (
                not self.offload
                and all(f.dtype == master_dtype for f in self.flats)
                and communication_dtype in (None, master_dtype)
            )
            accumulators = (
                None
                if in_place
                else build_grad_partitions(self.flats, offload=self.offload, pin_memory=pin, dtype=master_dtype)
            )
            return BoundaryReducer(
                self.flats,
                reducers,
                bucket_numel=config.reduce_bucket_size,
                communication_dtype=communication_dtype,
                accumulators=accumulators,
                share=share,
            )
        accumulators = build_grad_partitions(
            self.flats, offload=self.offload, pin_memory=pin, dtype=self.master_weights_and_grads_dtype
        )
        return BucketReducer(
            self.flats,
            reducers,
            accumulators,
            bucket_numel=config.reduce_bucket_size,
            overlap_comm=config.overlap_comm,
            communication_dtype=communication_dtype,
            ignore_unused_parameters=config.ignore_unused_parameters,
            share=share,
        )

    def _adopt_base_optimizer(self) -> None:
        if self.optimizer.state:
            logger.warning(
                "the base optimizer already has state for %d parameters; ZeRO starts it afresh on the partitions",
                len(self.optimizer.state),
            )
            self.optimizer.state.clear()
        for group, master in zip(self.optimizer.param_groups, self.masters, strict=True):
            group["params"] = [master]

    # ----- torch.optim.Optimizer surface (param_groups, state, defaults, loss_scale, ...: `WrappedOptimizer`) --
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        raise NotImplementedError(
            "ZeRO flattens the param groups at construction; build the base optimizer with "
            "every group before wrapping it"
        )

    def __repr__(self) -> str:
        return f"DeepSpeedZeroOptimizer(stage={self.zero_stage}, world={self.dp_world_size}, base={self.optimizer!r})"

    def _get_norm_groups(self) -> list[torch.Tensor]:
        """The L2 norm of each param group's current gradient, over all ranks (DeepSpeed's name); a collective.

        Completes this accumulation window's reduction first (stage 2: waits for the buckets still in
        flight; stage 1: reduces now, which `step()` then does not repeat, so no further backward may run
        before `step()` or `zero_grad()`), then measures the reduced gradient partitions as `step()` does
        (`ds_ops.precision.grad_norm_groups`: over the data-parallel group, parameters cut across the
        model-parallel group counted once). The gradients are read as held, before `step()` unscales or
        clips them: still multiplied by the loss scale under fp16, as DeepSpeed's stage-3 norms are.

        Returns:
            One 0-dim fp32 tensor per param group; one all-reduce over the data-parallel group (and one
            over the model-parallel group when given).
        """
        self._grads.finish()
        grads = self.grad_partitions
        return grad_norm_groups(
            [[g] for g in grads],
            group=self.dp_group,
            comm_device=self._comm_device,
            model_parallel_group=self.model_parallel_group,
            model_parallel_grads=self._cut.group_views(grads) if self._cut is not None else None,
        )

    # ----- training ------------------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """`(loss * loss_scale).backward()`; divide the loss by the accumulation steps before calling.

        Raises:
            ValueError: stage 1 already reduced this window's gradients (`_get_norm_groups()`); call
                `step()` or `zero_grad()` first.
        """
        if isinstance(self._grads, BoundaryReducer) and self._grads.reduced:
            raise ValueError(
                "ZeRO stage 1 already reduced this accumulation window's gradients (_get_norm_groups() was "
                "called); call step() or zero_grad() before the next backward"
            )
        self.loss_scaler.scale_loss(loss).backward(retain_graph=retain_graph)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear accumulated gradients: the fp32 partitions and any full gradients still held.

        Stage 1 keeps each parameter's `.grad` as a zeroed view of its flat gradient buffer whatever
        `set_to_none` says (autograd then accumulates into it without allocating); stage 2 sets it to None.
        """
        # Cleared only if written since the last clearing (a reduction, or a step: it unscales and clips), so
        # the engine's zero_grad() right after step()'s own skips a memset of every partition.
        written = self._grads.has_gradients or not self._partitions_clear
        self._grads.zero()
        if written and not self._grads_are_flat_views():
            for g, acc in enumerate(self.grad_partitions):  # or the next reduction writes over it (BucketReducer)
                if not (isinstance(self._grads, BucketReducer) and self._grads.clear(g)):
                    acc.zero_()
        self._partitions_clear = True

    def _deferrable_reducer(self) -> DeferrableReducer:
        return self._grads

    def graph_gradients(self) -> BoundaryReducer | BucketReducer:
        """The gradient reducer a DeepCompile backward graph hands gradients to (`ds_zero._compile.z12`):
        stage 1's boundary reducer or stage 2's bucket reducer, with `hand_to_graph`/`accept_graph_grad`.

        Raises:
            ValueError: this optimizer runs ZenFlow, whose gradients take another path.
        """
        if self._runs_zenflow or not isinstance(self._grads, (BoundaryReducer, BucketReducer)):
            raise ValueError(
                "compile.deepcompile at ZeRO stage 1/2 does not combine with zenflow (its gradients take another "
                "path); turn one of them off"
            )
        return self._grads

    def _grads_are_flat_views(self) -> bool:
        return isinstance(self._grads, BoundaryReducer) and self._grads.in_place

    def _finish_grads(self, skip: torch.Tensor | None) -> StepOutcome:
        """Unscale, check and clip this rank's gradient partitions (`ds_ops.precision.finish_step`)."""
        grads = self.grad_partitions
        return finish_step(
            grads,
            scaler=self.loss_scaler,
            clip=self.clip_grad,
            check_overflow=self.check_overflow,
            compute_norm=self._compute_norm,
            group=self.dp_group,
            partitioned=True,
            comm_device=self._comm_device,
            skip=skip,
            model_parallel_group=self.model_parallel_group,
            model_parallel_grads=self._cut.views(grads) if self._cut is not None else None,
        )

    def step(self, closure: Any = None, *, skip: torch.Tensor | None = None) -> bool:  # type: ignore[override]
        """Apply one optimizer step on every rank (a collective); returns False if it was skipped.

        Args:
            closure: not supported (the loss must go through `backward`).
            skip: a 1-element flag already agreed across the ranks that must skip together (the pipeline
                engine's stages); non-zero skips this step as an overflow does.

        Raises:
            TypeError: a closure is given.
        """
        if closure is not None:
            raise TypeError("DeepSpeedZeroOptimizer.step() takes no closure; call opt.backward(loss) then opt.step()")
        self._refuse_step_while_coalescing()
        for flat in self.flats:
            flat.check_views()
        self._grads.finish()
        self._partitions_clear = False
        grads = self.grad_partitions
        outcome = self._finish_grads(skip)
        if not self._record_outcome(outcome):
            return False
        if self._muon is not None:
            self._muon(grads)
        for master, grad in zip(self.masters, grads, strict=True):
            master.grad = grad
        self._updater.step()
        for master in self.masters:
            master.grad = None
        self._sync()
        self.zero_grad()
        return True

    # ----- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """THIS rank's partition and the metadata to rebuild full tensors (format: `ds_zero._checkpoint.format`)."""
        state = build_rank_state_dict(
            zero_stage=self.zero_stage,
            dp_rank=self.dp_rank,
            world_size=self.dp_world_size,
            flats=self.flats,
            masters=self.masters,
            optimizer=self.optimizer,
            loss_scaler=self.loss_scaler,
            overflow=self.overflow,
            clip_grad=self.clip_grad,
            offload=self.offload,
            shared_params=self.shared_params,
            frozen_param_shapes=self.frozen_param_shapes,
        )
        info = self._get_universal_checkpoint_info()
        if info is not None:  # a client's own description of its cuts, saved as DeepSpeed saves it
            state[UNIVERSAL_INFO_KEY] = info
        return state

    def load_state_dict(
        self,
        state_dicts: list[Mapping[str, Any]] | Mapping[str, Any],  # type: ignore[override]
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = True,
    ) -> None:
        """Restore from ALL saved ranks' state dicts (rank order), saved at this or any other world size.

        Each rank takes the slices of its new partition from whichever saved partitions hold them, so a
        save on 2 ranks loads on 4 and the other way round; at the same world size the result is
        bit-exact. Then the parameters are all-gathered (a collective: every rank must call this).

        Args:
            state_dicts: every saved rank's `state_dict()`, in rank order.
            load_optimizer_states: also restore the base optimizer's state and hyper-parameters.
            load_from_fp32_weights: restore the masters from the saved fp32 partitions; False keeps the
                model's current (e.g. just loaded 16-bit) weights and refreshes the masters from them.

        Raises:
            ValueError: missing or inconsistent ranks, parameters absent from the checkpoint, a different
                number of param groups (the message names what differs).
        """
        index = FragmentIndex(as_state_dict_list(state_dicts))
        first = index.state_dicts[0]
        if int(first["zero_stage"]) != self.zero_stage or index.world_size != self.dp_world_size:
            logger.info(
                "loading a stage-%s checkpoint saved on %d ranks into stage %d on %d ranks (re-partitioning)",
                first["zero_stage"],
                index.world_size,
                self.zero_stage,
                self.dp_world_size,
            )
        note_master_conversion(first, self.master_weights_and_grads_dtype)
        self.zero_grad()
        if load_from_fp32_weights:
            load_masters(index, self.flats, self.masters)
            with torch.no_grad():
                for flat, master, copy in zip(self.flats, self.masters, self._updater.copy_back, strict=True):
                    if copy:
                        flat.own_partition.copy_(master)
        else:
            self._updater.refresh_masters()
        if load_optimizer_states:
            load_base_optimizer_state(index, self.flats, self.masters, self.optimizer)
            for group, master in zip(self.optimizer.param_groups, self.masters, strict=True):
                group["params"] = [master]
        self.loss_scaler.load_state_dict(first["loss_scaler"])
        self.overflow = bool(first.get("overflow", False))
        self._sync()

    def refresh_fp32_params(self) -> None:
        """Reset the fp32 masters from the model's current weights (DeepSpeed's name)."""
        self._updater.refresh_masters()

    # ----- introspection -------------------------------------------------------------------------
    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds per role, each storage counted once (params first).

        Keys: `params` (flat model-dtype buffers, padding included), `fp32_master` (0 when the master is
        a view of the params), `optimizer_state`, `gradients` (fp32 partitions + staging or flat buffers).
        """
        return _memory_breakdown(self)

    def close(self) -> None:
        """Remove the gradient hooks (stage 2) and detach `.grad` views (stage 1)."""
        self._grads.close()

    def destroy(self) -> None:
        """`close()`, then free the offload buffers pinned by the native backend (DS_PIN_MEMORY_BACKEND=native).

        The optimizer must not be used afterwards: its fp32 partitions may point at freed memory.
        """
        self.close()
        if self.offload:
            release_pinned([*self.masters, *self.grad_partitions])

    #: Whether this class runs ZenFlow's loop (`ds_zero._zenflow.ZenFlowZeroOptimizer`); this one refuses the section.
    _runs_zenflow = False


ZeroOptimizer = DeepSpeedZeroOptimizer


def _check_arguments(optimizer: Any, config: Any, clip_grad: float, predivide: float, *, zenflow: bool) -> None:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    from ds_zero.config import ZeroConfig  # pydantic: loaded on first use, not at import

    if not isinstance(config, ZeroConfig):
        raise TypeError(
            f"config must be a ds_zero.ZeroConfig (the zero_optimization section), got "
            f"{type(config).__name__}; build it with ZeroConfig(**section)"
        )
    if config.stage not in (1, 2):
        hint = (
            "use ds_zero.DeepSpeedZeroOptimizer_Stage3"
            if config.stage == 3
            else "stage 0 is plain data parallelism, no ZeRO wrapper"
        )
        raise ValueError(
            f"zero_optimization.stage={config.stage}: DeepSpeedZeroOptimizer handles stages 1 and 2; {hint}"
        )
    if not zenflow:
        refuse_zenflow(config)
    if config.offload_optimizer_device == "nvme":
        raise ValueError(
            'zero_optimization.offload_optimizer.device="nvme" is not supported at stages 1 and 2 '
            '(NVMe offload, ZeRO-Infinity, is a stage-3 feature, as in DeepSpeed); use "cpu" here, or '
            "set zero_optimization.stage=3 to swap the optimizer state to NVMe"
        )
    if clip_grad < 0:
        raise ValueError(f"clip_grad (gradient_clipping) must be >= 0, got {clip_grad}")
    if predivide <= 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {predivide}")
    bucket = config.allgather_bucket_size
    if bucket % NCCL_START_ALIGNMENT_FACTOR:
        raise ds_comm.UsageError(
            "zero_optimization.allgather_bucket_size must be a multiple of nccl_start_alignment_factor "
            f"({NCCL_START_ALIGNMENT_FACTOR}) at stages 1 and 2, got {bucket}; use {bucket - 1} or {bucket + 1}"
        )


def _memory_breakdown(opt: DeepSpeedZeroOptimizer) -> dict[str, int]:
    seen: set[int] = set()

    def count(tensors: list[torch.Tensor]) -> int:
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    state = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return {
        "params": count([f.flat for f in opt.flats]),
        "fp32_master": count(opt.masters),
        "optimizer_state": count(state),
        "gradients": count(list(opt.grad_partitions) + opt._grads.gradient_tensors()),
    }
