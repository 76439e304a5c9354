"""`ZenFlowZeroOptimizer_Stage3`: ZeRO stage 3 with CPU optimizer offload and ZenFlow's importance-aware updates.

The loop is the stage-1/2 one (`ds_zero._zenflow.stage12`), on stage-3 partitions. Each micro step `m`:

1. at a selection step (`ZenFlowSchedule.is_select_boundary`) the host masters are reloaded from the
   model's shards and the selective optimizer's moments are cleared;
2. backward reduce-scatters the averaged gradient into each group's flat gradient partition, as plain
   ZeRO-3 does; at a selection step each weight's columns are chosen as DeepSpeed chooses them at ZeRO-3
   (`ds_zero._zenflow.shards`: per-column partial sums, one all-reduce, one top-k per weight among the
   columns whole inside one of DeepSpeed's transposed partitions);
3. after warm-up, the chosen columns' elements of this rank's shards are updated at once by ds-ops'
   `ZenFlowSelectiveAdamW` (a 1-D parameter's whole shard), or snapshotted on the step that ends the
   window; the parameters that stay gathered (persistent ones) are re-gathered;
4. the micro step's gradient partition is added into a host accumulator and dropped.

`step()` at the end of a window: unscale, inf/nan check, norm and clip over the accumulated partitions
(`ds_ops.precision.finish_step`), the CPU optimizer's update of the fp32 masters with ZenFlow's step
count (`ds_zero._zenflow.cpu_update`, or in a worker process with `overlap_step`:
`ds_zero._zenflow.overlap`), copied into the shards, then the selective step puts the snapshotted
columns back and updates them with this step's gradient, and the persistent parameters are re-gathered.

DeepSpeed 0.19.8 has this path for CUDA only; here it runs on any accelerator, CPU included.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

import ds_comm
from ds_ops import ZenFlowSelectiveAdamW
from ds_ops.precision import finish_step
from ds_zero._stage3.arguments import module_and_optimizer
from ds_zero._stage3.optimizer import DeepSpeedZeroOptimizer_Stage3
from ds_zero._zenflow.auto_update import AutoUpdateRule
from ds_zero._zenflow.checks import check_zenflow_setup, group_hyper_params, selective_params
from ds_zero._zenflow.common import ZenFlowOptimizerCommon
from ds_zero._zenflow.cpu_update import SequentialCpuUpdate
from ds_zero._zenflow.overlap import OverlappedCpuUpdate
from ds_zero._zenflow.schedule import ZenFlowSchedule
from ds_zero._zenflow.shards import ShardColumns, TileTarget, TileUpdater
from ds_zero._zenflow.state import load_selective_state, selective_state
from ds_zero._zero_config import as_zero_config

if TYPE_CHECKING:
    from ds_zero.config import ZeroConfig

logger = logging.getLogger(__name__)

__all__ = ["ZenFlowZeroOptimizer_Stage3"]

_KEY = "zero_optimization.zenflow"


class ZenFlowZeroOptimizer_Stage3(ZenFlowOptimizerCommon, DeepSpeedZeroOptimizer_Stage3):  # noqa: N801 - DeepSpeed's naming
    """ZeRO stage 3 with ZenFlow (see the module note): DeepSpeed's stage-3 ZenFlow path, on any accelerator.

    Args:
        *args: the module and the base optimizer, in either order (as for `DeepSpeedZeroOptimizer_Stage3`).
        config: the `zero_optimization` section, with `zenflow` set and `offload_optimizer.device: cpu`.
        steps_per_epoch: micro steps per epoch, for `select_strategy` "epoch"/"auto" (None: select once).
        selective_optimizer_params: the selective AdamW's default hyper-parameters (None: the base optimizer's
            group 0 lr, betas, eps and weight_decay); each group takes its base group's own values, as in
            DeepSpeed's stage-3 path.
        **kwargs: as for `DeepSpeedZeroOptimizer_Stage3`.

    Raises:
        ValueError: what `ZenFlowZeroOptimizer` refuses (no zenflow section, no CPU optimizer offload,
            `zenflow.offload` without `overlap_comm`, refused intervals, parameters of more than 2 dims),
            and at stage 3 also `offload_optimizer.super_offload`, `offload_optimizer.ratio` < 1, Muon
            groups, tensor parallelism, and `offload_param.device: nvme`; each names the key.
        TypeError: the optimizer's `step` takes no `step_id`.
    """

    _runs_zenflow = True

    def __init__(
        self,
        *args: nn.Module | torch.optim.Optimizer,
        config: ZeroConfig | Mapping[str, Any] | None = None,
        module: nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        steps_per_epoch: int | None = None,
        selective_optimizer_params: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        module, optimizer = module_and_optimizer(args, module, optimizer)
        cfg = as_zero_config(config)
        zenflow = getattr(cfg, "zenflow", None)
        check_zenflow_setup(optimizer, cfg, zenflow, kwargs, stages=(3,), owner="ZenFlowZeroOptimizer_Stage3")
        _check_stage3(cfg, optimizer, kwargs)
        self.zenflow_schedule = ZenFlowSchedule.from_config(zenflow, steps_per_epoch=steps_per_epoch)
        self.zenflow_config = zenflow
        super().__init__(module=module, optimizer=optimizer, config=cfg, **kwargs)
        if any(part.shard16 is None for part in self.partitions if part.params):
            raise ValueError(
                f"{_KEY} at stage 3 needs each group's shards in one flat buffer of one dtype and device; "
                "zero_optimization.offload_param.device nvme (or mixed shard dtypes) is not supported with it"
            )
        self.micro_step = -1
        schedule = self.zenflow_schedule
        self.shard_columns = [
            [
                ShardColumns(p, part, off, self.world_size, schedule.topk_ratio)
                for p, off in zip(part.params, part.offsets, strict=True)
            ]
            for part in self.partitions
        ]
        self.accumulators = [torch.zeros_like(part.master) for part in self.partitions]
        # As DeepSpeed's stage-3 selective optimizer: each group takes its base group's hyper-parameters.
        self.selective_optimizer = ZenFlowSelectiveAdamW(
            [
                {
                    **group_hyper_params(self.optimizer.param_groups[part.group_index]),
                    "params": [sc.proxy for sc in cols],
                }
                for part, cols in zip(self.partitions, self.shard_columns, strict=True)
            ],
            offload=bool(zenflow.offload),
            bucket_size=cfg.allgather_bucket_size,
            **selective_params(optimizer, selective_optimizer_params),
        )
        self._cpu = self._make_cpu_update()
        num_weights = sum(sc.is_matrix for cols in self.shard_columns for sc in cols)
        #: `update_interval: "auto"`: the adaptive window (None with a fixed interval)
        self.auto_update = (
            AutoUpdateRule(schedule.topk_ratio, schedule.auto_ratio, num_weights) if schedule.auto_update else None
        )
        #: Seconds the training process spent in each CPU update (as `ZenFlowZeroOptimizer.cpu_update_times`).
        self.cpu_update_times: list[float] = []
        logger.info("ZenFlow (ZeRO-3): %s", schedule.describe())

    def _make_cpu_update(self) -> SequentialCpuUpdate | OverlappedCpuUpdate:
        tiles = self.tiles
        targets: list[Any] = [TileTarget(t) for t in tiles]
        masters = [t.master for t in tiles]
        updater = TileUpdater(self.partitions, len(tiles))
        if self.zenflow_schedule.overlap_step:
            return OverlappedCpuUpdate(
                self.optimizer,
                targets,
                masters,
                updater,
                self.zenflow_schedule,
                float(self.zenflow_config.pt_reserved_cores_perc),
                accumulators=self.accumulators,
                master_gradients=self._tile_gradients,
                master_groups=[t.group_index for t in tiles],
            )
        return SequentialCpuUpdate(self.optimizer, targets, masters, updater)  # type: ignore[arg-type]

    # ----- the gradient path ----------------------------------------------------------------------
    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """One ZenFlow micro step: steps 1-4 of the module note around the stage-3 backward."""
        self.micro_step += 1
        m = self.micro_step
        schedule = self.zenflow_schedule
        if schedule.is_select_boundary(m):
            if m != 0:
                self._cpu.refresh_masters()
            self.selective_optimizer.clear_selected_mv()
        super().backward(loss, retain_graph=retain_graph)
        self.reducer.finish()
        grads = self._micro_step_grads()
        if not schedule.in_warm_up(m):
            if schedule.is_select_boundary(m) or self.shard_columns and self._never_selected():
                self._choose_columns(grads)
            touched = self._attach_selected(grads)
            if self.auto_update is not None:
                self._observe_auto(grads, m)
            if self.is_zenflow_update_boundary(m):
                self.selective_optimizer.temp_copy_param(touched)
            else:
                self.selective_optimizer.group_step(touched)
                self.refresh_gathered()
        with torch.no_grad():
            for acc, grad in zip(self.accumulators, grads, strict=True):
                acc.add_(grad)
        for part in self.partitions:
            part.master.grad = None

    def _micro_step_grads(self) -> list[torch.Tensor]:
        """Each partition's gradient of this micro step (zeros where backward produced none)."""
        grads = []
        for part in self.partitions:
            if part.master.grad is None:
                part.master.grad = torch.zeros_like(part.master)
            grads.append(part.master.grad)
        return grads

    def _never_selected(self) -> bool:
        return any(sc.is_matrix and sc.proxy.selected_indices is None for cols in self.shard_columns for sc in cols)

    def _choose_columns(self, grads: list[torch.Tensor]) -> None:
        """Choose every weight's columns (module note, step 2). One all-reduce of the column sums."""
        matrices = [(sc, grad) for cols, grad in zip(self.shard_columns, grads, strict=True) for sc in cols]
        matrices = [(sc, grad) for sc, grad in matrices if sc.is_matrix]
        if not matrices:
            return
        sums = torch.zeros(sum(sc.num_columns for sc, _ in matrices), dtype=torch.float32)
        offset = 0
        for sc, grad in matrices:
            sc.add_column_sums(grad, sums[offset : offset + sc.num_columns])
            offset += sc.num_columns
        if self.world_size > 1:
            reduced = sums.to(self._norm_device)
            ds_comm.all_reduce(reduced, group=self.dp_group)
            sums = reduced.to("cpu")
        offset = 0
        for sc, _ in matrices:
            if sc.choose(sums[offset : offset + sc.num_columns]):
                self._reset_moments(sc.proxy)
            offset += sc.num_columns

    def _reset_moments(self, proxy: nn.Parameter) -> None:
        """A new selection of another size on this rank: its (cleared) moments are made anew at that size."""
        state = self.selective_optimizer.state.get(proxy)
        if state:
            for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                state.pop(name, None)
        for name in ("exp_avg_cpu_data", "exp_avg_sq_cpu_data"):
            if getattr(proxy, name, None) is not None:
                setattr(proxy, name, None)

    def _attach_selected(self, grads: list[torch.Tensor]) -> dict[int, list[nn.Parameter]]:
        scale = float(self.loss_scaler.loss_scale)
        return {
            g: [sc.attach(grad, scale) for sc in cols]
            for g, (cols, grad) in enumerate(zip(self.shard_columns, grads, strict=True))
        }

    def _drop_selection_inputs(self) -> None:
        for cols in self.shard_columns:
            for sc in cols:
                sc.drop_inputs()

    def _observe_auto(self, grads: list[torch.Tensor], m: int) -> None:
        """Feed the adaptive rule every weight's |gradient| sums (whole, selected columns): this rank's
        shards' partial sums, added over the ranks with one all-reduce, so every rank decides the same."""
        scale = float(self.loss_scaler.loss_scale)
        sums = []
        for cols, grad in zip(self.shard_columns, grads, strict=True):
            for sc in cols:
                if sc.is_matrix:
                    sums.append(sc.shard(grad).abs().sum().double().cpu() / scale)
                    sums.append(sc.proxy.selected_grad.abs().sum().double().cpu())  # type: ignore[attr-defined]
        both = torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64)
        if self.world_size > 1 and both.numel():
            reduced = both.to(self._norm_device)
            ds_comm.all_reduce(reduced, group=self.dp_group)
            both = reduced.cpu()
        self.auto_update.observe(m, both[0::2], both[1::2])  # type: ignore[union-attr]

    def selective_optimizer_step(self) -> None:
        """DeepSpeed's name: update the selected columns with the proxies' `selected_grad` now."""
        self.selective_optimizer.step()
        self.refresh_gathered()

    # ----- the window's update ----------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None, *, skip: torch.Tensor | None = None) -> bool:
        """The end of an update window: the CPU update of the accumulated gradients, then the selected columns.

        Returns False (nothing applied, the window's gradients dropped) when an inf/nan skips the step.

        Raises:
            ValueError: a closure is given.
        """
        if closure is not None:
            raise ValueError("ZenFlowZeroOptimizer_Stage3.step() does not take a closure")
        self._refuse_step_while_coalescing()
        self.reducer.finish()
        if self.auto_update is not None:  # the window's mean (no loss was divided: its length was not known)
            for acc in self.accumulators:
                acc.div_(self.auto_update.mean_divisor())
            self.auto_update.restart()
        for part, acc in zip(self.partitions, self.accumulators, strict=True):
            part.master.grad = acc
        outcome = finish_step(
            list(self.accumulators),
            scaler=self.loss_scaler,
            clip=self.clip_grad,
            check_overflow=self.check_overflow,
            compute_norm=True,
            group=self.dp_group,
            partitioned=True,
            comm_device=self._norm_device,
            skip=skip,
        )
        for part in self.partitions:
            part.master.grad = None
        if not self._record_outcome(outcome):
            self._clear_accumulators()
            self._drop_selection_inputs()
            return False
        started = time.perf_counter()
        handed_over = self._cpu.update(
            self._tile_gradients(self.accumulators), step_id=self.micro_step + 1, sync=lambda: None
        )
        self.cpu_update_times.append(time.perf_counter() - started)
        if not handed_over:
            self._clear_accumulators()
        if not self.zenflow_schedule.in_warm_up(self.micro_step + 1):
            self.selective_optimizer.step()
        self.refresh_gathered()
        return True

    def _tile_gradients(self, accumulators: list[torch.Tensor]) -> list[torch.Tensor]:
        """Each tile's gradient: its range of its partition's accumulator."""
        index = {id(part): i for i, part in enumerate(self.partitions)}
        return [accumulators[index[id(t.partition)]][t.start : t.end] for t in self.tiles]

    def _clear_accumulators(self) -> None:
        for acc in self.accumulators:
            acc.zero_()

    # ----- checkpoints ---------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's stage-3 state (`stage3_state_dict`) plus ZenFlow's (`zenflow`: micro step, each weight's
        chosen columns, the selective optimizer's state and host moments, this rank's accumulated gradients),
        so that a resumed run continues the same windows and selections.

        The fp32 values saved are the masters except where the selective step owns the elements (the chosen
        columns, and 1-D parameters once selective steps started): there the shards are the truth (the
        masters' copies are stale until the next reselection reloads them), so the checkpoint's fp32 weights
        are the model's. Nothing here changes the running optimizer.

        With `overlap_step` the save first waits for the CPU update in flight; it adds the worker's optimizer
        state, the pending result and the model's shards (one window behind the masters by design).
        """
        overlap = self._cpu.state_dict() if isinstance(self._cpu, OverlappedCpuUpdate) else None
        state = super().state_dict()
        self._patch_owned_values(state["single_partition_of_fp32_groups"])
        state["zenflow"] = {
            "micro_step": self.micro_step,
            "world_size": self.world_size,
            "dp_rank": self.dp_rank,
            "selected_columns": [
                [None if sc.selected_columns is None else sc.selected_columns.clone() for sc in cols]
                for cols in self.shard_columns
            ],
            "selective_optimizer": selective_state(self.selective_optimizer),
            "accumulators": [acc.clone() for acc in self.accumulators],
            "auto_update": None if self.auto_update is None else self.auto_update.state_dict(),
        }
        if overlap is not None:
            overlap["model"] = [None if part.shard16 is None else part.shard16.clone() for part in self.partitions]
            state["zenflow"]["overlap"] = overlap
        return state

    def _patch_owned_values(self, values: list[torch.Tensor]) -> None:
        """Write the shards' values of the selective-owned elements into the saved fp32 tile values."""
        started = not self.zenflow_schedule.in_warm_up(self.micro_step) and self.micro_step >= 0
        index = {id(part): i for i, part in enumerate(self.partitions)}
        for tile, value in zip(self.tiles, values, strict=False):
            for sc in self.shard_columns[index[id(tile.partition)]]:
                positions = sc.owned_positions(started)
                if positions is None or not positions.numel():
                    continue
                at = positions + sc.offset
                keep = (at >= tile.start) & (at < tile.end)
                at = at[keep]
                value[at - tile.start] = tile.partition.shard16[at].to(value.dtype)

    def load_state_dict(
        self,
        state_dicts: list[Mapping[str, Any]] | Mapping[str, Any],
        load_optimizer_states: bool = True,
        load_from_fp32_weights: bool = True,
    ) -> None:
        """The stage-3 load (any saved world size), then ZenFlow's state of this rank (same world size only).

        A checkpoint without ZenFlow state (saved by plain ZeRO) loads with a warning: selection and windows
        start afresh.

        Raises:
            ValueError: the ZenFlow state was saved on another number of data-parallel ranks (the columns
                and the selective moments belong to the ranks' shards), naming the key.
        """
        saved_list = list(state_dicts) if isinstance(state_dicts, list) else [state_dicts]
        found = [z for z in (sd.get("zenflow") for sd in saved_list) if z is not None]
        same_world = bool(found) and int(found[0]["world_size"]) == self.world_size == len(found)
        if found and load_optimizer_states and not same_world:
            raise ValueError(
                f"{_KEY}: the checkpoint's ZenFlow state was saved on {found[0]['world_size']} data-parallel "
                f"ranks ({len(found)} given), this run has {self.world_size}; ZenFlow at stage 3 resumes at the "
                "same world size only (load_optimizer_states=False restarts its selection)"
            )
        super().load_state_dict(state_dicts, load_optimizer_states, load_from_fp32_weights)
        if not found:
            logger.warning("ZenFlow: the checkpoint has no ZenFlow state; selection and windows start afresh")
            return
        self.micro_step = int(found[0]["micro_step"])  # the schedule's position (the engine's counters resume)
        if not load_optimizer_states:
            return
        saved = next(z for z in found if int(z["dp_rank"]) == self.dp_rank)
        for cols, chosen in zip(self.shard_columns, saved["selected_columns"], strict=True):
            for sc, columns in zip(cols, chosen, strict=True):
                if columns is not None:
                    sc.use_columns(columns.to(torch.long))
                sc.point_at_shard()
        load_selective_state(self.selective_optimizer, saved["selective_optimizer"])
        for acc, value in zip(self.accumulators, saved["accumulators"], strict=True):
            acc.copy_(value)
        if self.auto_update is not None and saved.get("auto_update") is not None:
            self.auto_update.load_state_dict(saved["auto_update"])
        self._load_overlap(saved.get("overlap"))

    def _restore_overlapped_model(self, values: list[torch.Tensor | None]) -> None:
        """The model's own (delayed) shards an `overlap_step` checkpoint saved, then the gathered copies."""
        for part, value in zip(self.partitions, values, strict=True):
            if value is not None:
                part.shard16.copy_(value)
        self.refresh_gathered(include_frozen=True)

    def close(self) -> None:
        """Stop the CPU update worker (overlap_step)."""
        self._cpu.close()

    def destroy(self) -> None:
        """`close()`, then the stage-3 teardown."""
        self._cpu.close()
        super().destroy()

    def __repr__(self) -> str:
        return (
            f"ZenFlowZeroOptimizer_Stage3(world={self.world_size}, {self.zenflow_schedule.describe()}, "
            f"base={self.optimizer!r})"
        )


def _check_stage3(cfg: Any, optimizer: torch.optim.Optimizer, kwargs: Mapping[str, Any]) -> None:
    """What ZeRO-3 offers that ZenFlow's loop here does not run with."""
    off = cfg.offload_optimizer_or_default
    if off.super_offload:
        raise ValueError(
            f"{_KEY} with zero_optimization.offload_optimizer.super_offload=true: both change when the CPU "
            "optimizer steps; use one of them"
        )
    if off.ratio < 1.0:
        raise ValueError(
            f"{_KEY} with zero_optimization.offload_optimizer.ratio={off.ratio}: ZenFlow applies the CPU update "
            "to every partition; set ratio 1 (full offload) or remove the zenflow section"
        )
    if any(g.get("use_muon", False) for g in optimizer.param_groups):
        raise ValueError(f"{_KEY} with Muon param groups (use_muon=True) is not supported; use Adam/AdamW")
    if kwargs.get("model_parallel_group") is not None:
        raise ValueError(
            f"{_KEY} with tensor parallelism (tensor_parallel.autotp_size > 1) is not supported at stage 3 in ds"
        )
