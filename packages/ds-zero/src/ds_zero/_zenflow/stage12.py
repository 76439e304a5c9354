"""`ZenFlowZeroOptimizer`: ZeRO stage 1/2 with CPU optimizer offload and ZenFlow's importance-aware updates.

Each micro step `m` (one `backward`):

1. at a selection step (`ZenFlowSchedule.is_select_boundary`) the host masters are refreshed from the
   model's weights (the selected columns moved on the device since) and the selective optimizer's
   moments are cleared;
2. the backward's gradients are averaged over the data-parallel group (`MicroStepGradients`); at a
   selection step the top `topk_ratio` columns of each weight are chosen from them (`ColumnPlan`, DeepSpeed's
   choice per partition); after warm-up each parameter gets `selected_grad` (those columns; a 1-D
   parameter's whole gradient);
3. on a step that does not end the update window, ds-ops' `ZenFlowSelectiveAdamW` updates the selected
   columns at once; on one that does, it snapshots them (the CPU update will overwrite them);
4. this rank's partition of the averaged gradient is added to the host accumulator.

`step()` at the end of a window: norm, clip and the overflow check over the accumulated partitions, the
CPU optimizer's update (`ds_ops.ZenFlowCPUAdam`, bias correction by micro step `m + 1`), the all-gather
of the partitions, then the selective optimizer puts the snapshotted columns back and updates them with
this step's gradient: the selected columns never take the CPU's (delayed) update.

With `overlap_step` the CPU update runs in a worker process while the next window's micro steps go on
(`ds_zero._zenflow.overlap`); its result is applied at the next window's end, one window late, as in
DeepSpeed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

import ds_comm
from ds_ops import ZenFlowSelectiveAdamW
from ds_zero._stage12.optimizer import DeepSpeedZeroOptimizer
from ds_zero._stage12.partitions import build_grad_partitions
from ds_zero._stage12.reduce import RangeReducer
from ds_zero._zenflow.auto_update import AutoUpdateRule
from ds_zero._zenflow.checks import check_zenflow_setup, selective_params
from ds_zero._zenflow.columns import ColumnPlan
from ds_zero._zenflow.common import ZenFlowOptimizerCommon
from ds_zero._zenflow.cpu_update import SequentialCpuUpdate
from ds_zero._zenflow.gradients import MicroStepGradients
from ds_zero._zenflow.overlap import OverlappedCpuUpdate
from ds_zero._zenflow.schedule import ZenFlowSchedule
from ds_zero._zenflow.state import load_selective_state, selective_state

if TYPE_CHECKING:
    from ds_zero.config import ZeroConfig

logger = logging.getLogger(__name__)

__all__ = ["ZenFlowZeroOptimizer"]

_KEY = "zero_optimization.zenflow"


class ZenFlowZeroOptimizer(ZenFlowOptimizerCommon, DeepSpeedZeroOptimizer):
    """ZeRO stage 1/2 with ZenFlow (see the module note). DeepSpeed's `ZenFlowZeroOptimizer`.

    Args:
        optimizer: the CPU optimizer over the model's parameters; its `step` must take `step_id`
            (`ds_ops.ZenFlowCPUAdam`, what `deepspeed.initialize` builds for Adam/AdamW with ZenFlow).
        config: the `zero_optimization` section, with `zenflow` set and `offload_optimizer.device: cpu`.
        steps_per_epoch: micro steps per epoch, for `select_strategy` "epoch"/"auto" (None: select once).
        selective_optimizer_params: the selective AdamW's hyper-parameters (the config's optimizer params;
            None: each group's lr, betas, eps and weight_decay from `optimizer`).
        **kwargs: as for `DeepSpeedZeroOptimizer`.

    Raises:
        ValueError: no zenflow section, no CPU optimizer offload, `zenflow.offload` without
            `overlap_comm`, a refused interval combination (`ZenFlowSchedule`), per-group partition
            groups (MoE), or a parameter of more than 2 dimensions; each names the key.
        TypeError: the optimizer's `step` takes no `step_id`.
    """

    _runs_zenflow = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        config: ZeroConfig,
        steps_per_epoch: int | None = None,
        selective_optimizer_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        zenflow = getattr(config, "zenflow", None)
        check_zenflow_setup(optimizer, config, zenflow, kwargs, stages=(1, 2), owner="ZenFlowZeroOptimizer")
        self.zenflow_schedule = ZenFlowSchedule.from_config(zenflow, steps_per_epoch=steps_per_epoch)
        self.zenflow_config = zenflow
        super().__init__(optimizer, config=config, **kwargs)
        self.micro_step = -1
        schedule = self.zenflow_schedule
        self.column_plans = [
            ColumnPlan(
                [s.shape for s in f.slots], ds_comm.get_world_size(pg), schedule.topk_ratio, [s.name for s in f.slots]
            )
            for f, pg in zip(self.flats, self.partition_groups, strict=True)
        ]
        self.selective_optimizer = ZenFlowSelectiveAdamW(
            [{"params": list(f.params)} for f in self.flats],
            offload=bool(zenflow.offload),
            bucket_size=config.allgather_bucket_size,
            **selective_params(optimizer, selective_optimizer_params),
        )
        self._cpu = self._make_cpu_update()
        num_weights = sum(len(s.shape) == 2 for f in self.flats for s in f.slots)
        #: `update_interval: "auto"`: the adaptive window (None with a fixed interval)
        self.auto_update = (
            AutoUpdateRule(schedule.topk_ratio, schedule.auto_ratio, num_weights) if schedule.auto_update else None
        )
        #: Seconds the training process spent in each CPU update so far (with overlap_step: waiting for the
        #: worker, copying its result, handing over the window; the first includes starting the worker). The
        #: all-gather of the updated partitions that follows, which every ZeRO-1/2 step makes, is not counted
        #: (stage 3 has none: its shards are gathered by the next forward).
        self.cpu_update_times: list[float] = []
        logger.info("ZenFlow: %s", schedule.describe())

    def _make_cpu_update(self) -> SequentialCpuUpdate | OverlappedCpuUpdate:
        if self.zenflow_schedule.overlap_step:
            return OverlappedCpuUpdate(
                self.optimizer,
                self.flats,
                self.masters,
                self._updater,
                self.zenflow_schedule,
                float(self.zenflow_config.pt_reserved_cores_perc),
                accumulators=self._grads.accumulators,
                master_gradients=list,  # accumulator i is master i's gradient
            )
        return SequentialCpuUpdate(self.optimizer, self.flats, self.masters, self._updater)

    # ----- the gradient path ----------------------------------------------------------------------
    def _build_reduction(self, config: ZeroConfig, reducers: list[RangeReducer], communication_dtype, pin):  # type: ignore[no-untyped-def,override]
        accumulators = build_grad_partitions(
            self.flats, offload=True, pin_memory=pin, dtype=self.master_weights_and_grads_dtype
        )
        return MicroStepGradients(
            self.flats,
            accumulators,
            group=self.dp_group,
            average=self.gradient_average,
            communication_dtype=communication_dtype,
        )

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """One ZenFlow micro step: steps 1-4 of the module note around `(loss * loss_scale).backward()`."""
        self.micro_step += 1
        m = self.micro_step
        schedule = self.zenflow_schedule
        if schedule.is_select_boundary(m):
            if m != 0:
                self._cpu.refresh_masters()
            self.selective_optimizer.clear_selected_mv()
        self.loss_scaler.scale_loss(loss).backward(retain_graph=retain_graph)
        averaged = self._grads.average_micro_step()
        if not schedule.in_warm_up(m):
            touched = self._select(averaged, reselect=schedule.is_select_boundary(m))
            if self.auto_update is not None:
                self._observe_auto(averaged, m)
            if self.is_zenflow_update_boundary(m):
                self.selective_optimizer.temp_copy_param(touched)
            else:
                self.selective_optimizer.group_step(touched)
        self._grads.accumulate()
        self._grads.zero()

    def _select(self, averaged: list[torch.Tensor], *, reselect: bool) -> dict[int, list[torch.Tensor]]:
        """Hang `selected_indices` (when reselecting) and `selected_grad` on every parameter; by group index."""
        scale = float(self.loss_scaler.loss_scale)
        touched: dict[int, list[torch.Tensor]] = {}
        for g, (flat, plan, grads) in enumerate(zip(self.flats, self.column_plans, averaged, strict=True)):
            params = []
            for p, slot, cols in zip(flat.params, flat.slots, plan.params, strict=True):
                grad = flat.slot_view(grads, slot)
                if cols.is_matrix:
                    if reselect or getattr(p, "selected_indices", None) is None:
                        p.selected_indices = cols.select(grad)
                    selected = grad.index_select(1, p.selected_indices.to(grad.device))
                else:
                    selected = grad.clone()
                p.selected_grad = selected if scale == 1.0 else selected.div_(scale)
                params.append(p)
            touched[g] = params
        return touched

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the micro step's gradients; the host accumulators are cleared only by the CPU update."""
        self._grads.zero()

    def _observe_auto(self, averaged: list[torch.Tensor], m: int) -> None:
        """Feed the adaptive rule this micro step's |gradient| sums of every weight (every rank holds the
        whole averaged gradient, so every rank decides the same)."""
        scale = float(self.loss_scaler.loss_scale)
        totals, criticals = [], []
        for flat, grads in zip(self.flats, averaged, strict=True):
            for p, slot in zip(flat.params, flat.slots, strict=True):
                if len(slot.shape) == 2:
                    totals.append(flat.slot_view(grads, slot).abs().sum().float().cpu() / scale)
                    criticals.append(p.selected_grad.abs().sum().float().cpu())  # type: ignore[attr-defined]
        empty = torch.zeros(0)
        self.auto_update.observe(  # type: ignore[union-attr]
            m, torch.stack(totals) if totals else empty, torch.stack(criticals) if criticals else empty
        )

    # ----- the window's update ----------------------------------------------------------------------
    def step(self, closure: Any = None, *, skip: torch.Tensor | None = None) -> bool:  # type: ignore[override]
        """The end of an update window: the CPU update of the accumulated gradients, then the selected columns.

        Returns False (nothing applied, the window's gradients dropped) when an inf/nan skips the step.

        Raises:
            TypeError: a closure is given.
        """
        if closure is not None:
            raise TypeError("ZenFlowZeroOptimizer.step() takes no closure; call opt.backward(loss) then opt.step()")
        self._refuse_step_while_coalescing()
        for flat in self.flats:
            flat.check_views()
        grads = self.grad_partitions
        if self.auto_update is not None:  # the window's mean (no loss was divided: its length was not known)
            for acc in grads:
                acc.div_(self.auto_update.mean_divisor())
            self.auto_update.restart()
        outcome = self._finish_grads(skip)
        if not self._record_outcome(outcome):
            self._grads.clear_accumulators()
            self._drop_selection_inputs()
            return False
        gather_s = 0.0

        def timed_sync() -> None:
            nonlocal gather_s
            begun = time.perf_counter()
            self._sync()
            gather_s += time.perf_counter() - begun

        started = time.perf_counter()
        handed_over = self._cpu.update(grads, step_id=self.micro_step + 1, sync=timed_sync)
        self.cpu_update_times.append(time.perf_counter() - started - gather_s)
        if not handed_over:
            self._grads.clear_accumulators()
        if not self.zenflow_schedule.in_warm_up(self.micro_step + 1):
            self.selective_optimizer.step()
        return True

    # ----- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The ZeRO partition state plus ZenFlow's (`zenflow`: micro step, selections, selective optimizer
        state, this rank's accumulated gradients), so a resumed run continues the same schedule.

        With `overlap_step` the save first waits for the CPU update in flight; it adds the worker's optimizer
        state, the pending result and this rank's model partitions (one window behind the masters by design).
        """
        overlap = self._cpu.state_dict() if isinstance(self._cpu, OverlappedCpuUpdate) else None
        state = super().state_dict()
        self._patch_owned_values(state["single_partition_of_fp32_groups"])
        state["zenflow"] = {
            "micro_step": self.micro_step,
            "world_size": self.dp_world_size,
            "selected_indices": [[getattr(p, "selected_indices", None) for p in flat.params] for flat in self.flats],
            "selective_optimizer": selective_state(self.selective_optimizer),
            "accumulators": [acc.clone() for acc in self.grad_partitions],
            "auto_update": None if self.auto_update is None else self.auto_update.state_dict(),
        }
        if overlap is not None:
            overlap["model"] = [flat.own_partition.detach().clone() for flat in self.flats]
            state["zenflow"]["overlap"] = overlap
        return state

    def _patch_owned_values(self, values: list[torch.Tensor]) -> None:
        """Write the model's values of the selective-owned elements into the saved fp32 partitions.

        The masters' copies of the selected columns (and, once selective steps started, of the 1-D
        parameters) are stale by design: the selective step updates the model there and the next
        reselection reloads the masters. Taking those elements from the model makes the checkpoint's fp32
        weights the real ones (zero_to_fp32, resume) without touching the running masters (a save must not
        change the run: a refresh would round 16-bit models' other master elements).
        """
        started = self.micro_step >= 0 and not self.zenflow_schedule.in_warm_up(self.micro_step)
        for flat, value in zip(self.flats, values, strict=True):
            owned = torch.zeros(flat.padded_numel, dtype=torch.bool)
            for p, slot in zip(flat.params, flat.slots, strict=True):
                view = flat.slot_view(owned, slot)
                indices = getattr(p, "selected_indices", None)
                if view.dim() == 2 and indices is not None:
                    view[:, indices.to("cpu")] = True
                elif view.dim() != 2 and started:
                    view.fill_(True)
            mine = flat.own_slice(owned).nonzero().squeeze(1)
            if mine.numel():
                value[mine] = flat.own_partition.detach()[mine.to(flat.device)].to("cpu", value.dtype)

    def load_state_dict(  # type: ignore[override]
        self,
        state_dicts: list[Mapping[str, Any]] | Mapping[str, Any],
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = True,
    ) -> None:
        """`DeepSpeedZeroOptimizer.load_state_dict`, then ZenFlow's state of this rank (same world size only).

        Raises:
            ValueError: the ZenFlow state was saved at another data-parallel world size (the columns are
                chosen per partition).
        """
        super().load_state_dict(state_dicts, load_optimizer_states, load_from_fp32_weights)
        saved_list = state_dicts if isinstance(state_dicts, list) else [state_dicts]
        saved = saved_list[self.dp_rank if len(saved_list) > 1 else 0].get("zenflow")
        if saved is None:
            logger.warning("ZenFlow: the checkpoint has no ZenFlow state; selection and windows start afresh")
            return
        if int(saved["world_size"]) != self.dp_world_size:
            raise ValueError(
                f"{_KEY}: the checkpoint's ZenFlow state was saved on {saved['world_size']} data-parallel ranks, "
                f"this run has {self.dp_world_size}; ZenFlow resumes at the same world size only"
            )
        self.micro_step = int(saved["micro_step"])
        for flat, indices in zip(self.flats, saved["selected_indices"], strict=True):
            for p, idx in zip(flat.params, indices, strict=True):
                p.selected_indices = idx
        if load_optimizer_states:
            load_selective_state(self.selective_optimizer, saved["selective_optimizer"])
            for acc, value in zip(self.grad_partitions, saved["accumulators"], strict=True):
                acc.copy_(value)
            if self.auto_update is not None and saved.get("auto_update") is not None:
                self.auto_update.load_state_dict(saved["auto_update"])
            self._load_overlap(saved.get("overlap"))

    def _restore_overlapped_model(self, values: list[torch.Tensor | None]) -> None:
        """The model's own (delayed) partitions an `overlap_step` checkpoint saved."""
        for flat, value in zip(self.flats, values, strict=True):
            flat.own_partition.copy_(value)
        self._sync()

    def _drop_selection_inputs(self) -> None:
        for flat in self.flats:
            for p in flat.params:
                p.selected_grad = None
                if hasattr(p, "temp_selected_param"):
                    p.temp_selected_param = None

    def selective_optimizer_step(self) -> None:
        """DeepSpeed's name: update the selected columns with the parameters' `selected_grad` now."""
        self.selective_optimizer.step()

    def close(self) -> None:
        """Stop the CPU update worker (overlap_step) and remove the gradient views."""
        self._cpu.close()
        super().close()

    def __repr__(self) -> str:
        return (
            f"ZenFlowZeroOptimizer(stage={self.zero_stage}, world={self.dp_world_size}, "
            f"{self.zenflow_schedule.describe()}, base={self.optimizer!r})"
        )
