"""SuperOffload: the CPU optimizer steps ZeRO-3's offloaded sub-groups during the backward, speculatively.

`zero_optimization.offload_optimizer.super_offload` (DeepSpeed 0.19.8; there for NVIDIA Grace-Hopper
superchips, here on any accelerator, CPU included). With the optimizer offloaded to the CPU the step is
the CPU optimizer's pass over every sub-group after the backward. SuperOffload starts that pass early:
on the backward that ends the accumulation window, each sub-group (tile) is stepped on a worker thread
as soon as the reduce-scatters have delivered its last gradient piece, while the backward computes the
earlier layers. The worker uses `cpuadam_cores_perc` of the host's cores.

The update assumes the step is applied unclipped (`ds_zero._speculative`'s note). At `step()`, once
the overflow check and the global norm are known:

* skipped (inf/nan on any rank, or the caller's skip): every speculative update is undone exactly;
* clipped (global norm above `gradient_clipping`): every speculative update is undone and the step
  redoes it with the clipped gradient, like a step without SuperOffload;
* a tile whose gradient changed after its update (a late second gradient, reentrant checkpointing) or
  whose group's hyper-parameters changed before `step()`: that tile is undone and stepped again;
* otherwise the updates stand and only their 16-bit shards are written (not during the backward, which
  may still read them).

So the numbers are those of ZeRO-3 with CPU offload, bit for bit: the same gradient, hyper-parameters
and per-element arithmetic for every sub-group; only when each is computed changes.

A wrong guess costs an undo and (clipped) a second update, so the guess follows the last step: after a
step that was skipped or clipped the next backward does not speculate (clipping, when it happens, tends to
last for a while: early training, a loss spike) and the step runs as without SuperOffload; after a clean
step it speculates again. DeepSpeed's SuperOffload does not speculate at all when `gradient_clipping` is
set; this keeps the overlap for the steps clipping leaves alone.
"""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ds_ops.precision import StepOutcome
from ds_zero._params.partitioned_param import state_of
from ds_zero._params.shards import write_shards
from ds_zero._speculative import SpeculativeSteps

if TYPE_CHECKING:
    from ds_zero._stage3.partition import ShardTile

logger = logging.getLogger(__name__)

__all__ = ["SuperOffload", "worker_threads"]


def worker_threads(cores_perc: float) -> int:
    """Threads for the CPU optimizer: `cores_perc` of the cores this process may run on (at least 1),
    the share DeepSpeed pins its CPU Adam process to."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores - int((1.0 - cores_perc) * cores))


def write_tile_shards(tile: ShardTile) -> None:
    """Copy a tile's updated fp32 master into its model-dtype shards (the step's last write)."""
    if tile.partition.master_is_shard:
        return
    with torch.no_grad():
        flat = tile.shard16()
        if flat is not None:
            flat.copy_(tile.master)
        else:
            write_shards(
                tile.params,
                [
                    tile.master[off : off + state_of(p).shard_numel]
                    for p, off in zip(tile.params, tile.offsets, strict=True)
                ],
            )


class SuperOffload:
    """Speculative in-backward steps of the CPU sub-groups of one `DeepSpeedZeroOptimizer_Stage3`.

    Args:
        optimizer: the stage-3 optimizer (its base optimizer, tiles and loss scaler are used).
        tiles: the tiles stepped speculatively (those whose master and state live on the CPU).
        cores_perc: `offload_optimizer.cpuadam_cores_perc`.
    """

    def __init__(self, optimizer: Any, tiles: list[ShardTile], *, cores_perc: float) -> None:
        self.zero = optimizer
        self.tiles = [t for t in tiles if t.numel]
        self._tile_of = {id(p): t for t in self.tiles for p in t.params}
        self._count: dict[int, int] = {}
        self._launched: set[int] = set()
        self._stale: set[ShardTile] = set()
        self._armed = False
        self._last_clean = True  # the last step was applied unclipped (the guess for the next one)
        self._backward_seen = False
        #: speculate only after a clean step (the module note); False: on every boundary backward
        self.follow_last_step = True
        self.num_threads = worker_threads(cores_perc)
        self.steps = SpeculativeSteps(optimizer.optimizer, self._step_tile, num_threads=self.num_threads)
        #: tiles whose speculative update the last `settle` kept (the base step leaves them alone)
        self.done: set[int] = set()
        #: counters for tests and reports: tiles updated during backward / undone (skip, clip, late, lr change)
        self.num_speculative = 0
        self.num_undo_copies = 0
        self.num_undone = 0

    # ---------------------------------------------------------------- during backward
    def arm(self, boundary: bool) -> None:
        """A backward starts; it ends the accumulation window when `boundary` (only then are gradients final)."""
        self._count.clear()
        self._launched.clear()
        self._stale.clear()
        guess = self._last_clean or not self.follow_last_step
        self._armed = boundary and guess and not self.zero.reducer.deferred

    def on_piece(self, param: nn.Parameter) -> None:
        """The reducer added `param`'s reduced shard into its master gradient."""
        tile = self._tile_of.get(id(param))
        if tile is None:
            return
        key = id(tile)
        if key in self._launched:  # a second gradient after the tile was updated
            self._stale.add(tile)
            return
        count = self._count[key] = self._count.get(key, 0) + 1
        if self._armed and count == len(tile.params):
            self._launched.add(key)
            master = tile.partition.master
            assert master is not None and master.grad is not None  # the reducer just wrote this piece into it
            grad = master.grad[tile.start : tile.end]
            scale = self.zero.loss_scaler.loss_scale
            if scale != 1.0:  # the same product finish_step's unscale makes, in a copy (it unscales in place later)
                grad = grad * (1.0 / scale)
            copy = self._needs_undo()
            self.steps.submit(tile, tile.master, tile.group_index, grad, keep_undo=copy)
            self.num_speculative += 1
            self.num_undo_copies += copy

    def _needs_undo(self) -> bool:
        """Whether this step's updates may have to be undone, so an exact copy is kept first (it costs
        about two Adam passes of memory traffic): with an inf/nan check, clipping or a dynamic loss scale,
        and until a backward has shown that no parameter gets a second gradient (and whenever one did).
        Without any of them only an lr changed between the backward and `step()` could call for an undo;
        that update is kept, as DeepSpeed's SuperOffload keeps it (it reads the lr during the backward)."""
        z = self.zero
        return (
            z.check_overflow
            or z.clip_grad > 0
            or z.loss_scaler.dynamic
            or not self._backward_seen
            or z.reducer.saw_late
        )

    def _step_tile(self, tile: Any, grad: torch.Tensor, hyper: dict[str, Any]) -> None:
        """On the worker: the base optimizer's step on this tile alone, with the hyper-parameters its group
        had when the tile's gradient completed.

        The step runs on a private view of the base optimizer (`_private_view`): the same state, hooks and
        class, its own param groups. Narrowing the live groups instead would race with the caller's thread,
        which may read them or set an lr between the backward and `step()`; the update would then use the
        old lr or the new one depending on which thread got there first."""
        base = self.zero.optimizer
        view = _private_view(base, tile.group_index, tile.master, hyper)
        tile.master.grad = grad
        try:
            view.step()
        finally:
            tile.master.grad = None
        # torch's lr scheduler warns when it steps before the optimizer did; the view's step counts.
        base._opt_called = True  # type: ignore[attr-defined]

    # ---------------------------------------------------------------- at the step
    def wait(self) -> None:
        """End of the speculation window: every update submitted has landed."""
        self._armed = False
        self.steps.wait()
        self._backward_seen = True

    def settle(self, outcome: StepOutcome) -> None:
        """Keep, undo or mark for redo every speculative update, given the step's decision (after `wait`)."""
        self.done = set()
        self._last_clean = outcome.applied and outcome.clip_coef == 1.0
        if not self.steps.stepped:
            return
        if not outcome.applied or outcome.clip_coef != 1.0:
            undo = list(self.steps.stepped)
            why = "skipped step" if not outcome.applied else f"clipped gradients (coef {outcome.clip_coef:.4g})"
        else:
            undo = [t for t in self.steps.stepped if t in self._stale]
            changed = [t for t in self.steps.changed_hyper() if t not in self._stale]
            kept_old = [t for t in changed if not self.steps.restorable(t)]
            if kept_old:
                logger.warning(
                    "superoffload: the hyper-parameters changed between the backward and step(); %d sub-groups "
                    "were updated during the backward with the old ones and keep that update",
                    len(kept_old),
                )
            undo += [t for t in changed if self.steps.restorable(t)]
            why = "late gradient or changed hyper-parameters"
        if undo:
            logger.debug("superoffload: undoing %d speculative sub-group updates (%s)", len(undo), why)
            self.steps.undo(undo)
            self.num_undone += len(undo)
        kept = self.steps.commit()
        if outcome.applied:
            for tile in kept:
                write_tile_shards(tile)  # type: ignore[arg-type]  # the keys submitted here are tiles
            self.done = {id(t) for t in kept}

    def discard(self) -> None:
        """Gradients dropped without a step: undo whatever was updated from them."""
        self.wait()
        if self.steps.stepped:
            self.num_undone += len(self.steps.stepped)
            self.steps.undo_all()
        self.done = set()

    def close(self) -> None:
        self.steps.close()


def _private_view(
    base: torch.optim.Optimizer, group_index: int, param: torch.Tensor, hyper: dict[str, Any]
) -> torch.optim.Optimizer:
    """An optimizer object sharing `base`'s class, state and hooks whose only parameter is `param`, in group
    `group_index` with `hyper`; the other groups are present (some optimizers read every group's settings)
    but empty. Not `copy.copy`: torch's `Optimizer.__getstate__` would drop the subclass's own attributes."""
    view = object.__new__(type(base))
    view.__dict__.update(base.__dict__)
    view.__dict__.pop("step", None)  # an lr scheduler's wrapper on the instance would step `base` itself
    view.param_groups = [
        {**hyper, "params": [param]} if gi == group_index else {**group, "params": []}
        for gi, group in enumerate(base.param_groups)
    ]
    return view


def refuse_superoffload(base: torch.optim.Optimizer, cfg: Any) -> None:
    """What SuperOffload cannot do, refused before anything is built (the config model checked the rest)."""
    if not cfg.offload_optimizer_or_default.super_offload:
        return
    if any(g.get("use_muon", False) for g in base.param_groups):
        raise ValueError(
            "zero_optimization.offload_optimizer.super_offload=true with Muon (param groups with use_muon=True) is "
            "not supported: the Muon update needs every rank's whole matrix, not one sub-group's gradient; set "
            "super_offload to false"
        )
