"""`EagerSteps`: step each NVMe-swapped sub-group during backward, as soon as its gradient is complete.

[Note: why step in backward] With the optimizer on NVMe a step is bound by the disk: every sub-group's
fp32 master and Adam moments are read and written once (12 bytes per parameter each way), and waiting
for the end of backward leaves the disk idle through the whole backward and adds the gradient's own
round trip (4 bytes per parameter written in backward, read at the step). When this backward ends the
accumulation window (and the loss scale is 1), a sub-group can be updated the moment its last gradient
piece arrives: its state is read ahead while earlier layers' backward computes, the update uses the
gradient still in memory, and the write overlaps the rest of backward (with `pipeline_read`/
`pipeline_write`, as in `step()`). The result is the same update `step()` would make (same gradient,
same hyper-parameters, same order of operations within the sub-group).

The update is speculative (`ds_zero._speculative`'s note): an inf/nan anywhere (`bf16.check_grad_overflow`,
DeepSpeed's default) skips the step, a global norm above `gradient_clipping` scales every gradient, and
neither is known until the whole gradient is. So the update goes to the sub-group's spare swap files
(`OptimizerSwapper.spare_slot`), leaving the committed ones, the pre-update master and moments, as they
were; an `UndoRecord` keeps what lives in memory (the step count, the hyper-parameters). At `step()`,
`settle` commits the updates (the common case: the spare files become the committed ones), or undoes them
(skipped: nothing to copy back, the 16-bit shards are rewritten from the committed masters), or undoes
them for `step()` to redo with the clipped gradient, which is why with clipping the gradients are also
written to disk during the backward (`keep_grads`). Once this rank's own gradients show the step will be
skipped or clipped (`stop`), the remaining sub-groups are left for `step()`.

The sub-groups are expected in the order the previous backward completed them (recorded by the
`GradSwapper`); one that completes out of that order is simply left for `step()` (its gradient goes to
disk as usual), as is every sub-group after it. So is every sub-group whose spare files would not fit on
the swap disk (`fitting_on_disk`): the speed-up shrinks with the disk instead of a write failing mid-step.
The caller (`DeepSpeedZeroOptimizer_Stage3`) decides when eager stepping is allowed and steps the rest at
`step()`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ds_zero._params.partitioned_param import state_of
from ds_zero._params.shards import write_shards
from ds_zero._speculative import UndoRecord

if TYPE_CHECKING:
    from ds_ops.precision import StepOutcome
    from ds_zero._stage3.optimizer_swapper import OptimizerSwapper
    from ds_zero._stage3.partition import ShardTile

logger = logging.getLogger(__name__)

__all__ = ["EagerSteps", "arm_eager_steps"]


class EagerSteps:
    """Steps the sub-groups of `order` one by one as `offer` hands over their complete gradients.

    Args:
        swapper: the optimizer swapper (its buffer sets, reader and writer are used as in `step()`).
        order: the sub-groups in the order their gradients are expected to complete.
        step_fn: updates one bound sub-group (the base optimizer's step on it and its 16-bit shards).
        keep_grads: the gradients are written to disk as well (a clipped step redoes the updates from them).
        stop: asked before each update; True when the step is known to be skipped or clipped already
            (the remaining sub-groups are left for `step()`).
    """

    def __init__(
        self,
        swapper: OptimizerSwapper,
        order: list[ShardTile],
        step_fn: Callable[[ShardTile], None],
        *,
        keep_grads: bool = False,
        stop: Callable[[], bool] | None = None,
    ):
        self.swapper = swapper
        self.order = [t for t in order if t.numel]
        self.step_fn = step_fn
        self.keep_grads = keep_grads
        self.stop = stop
        self.pos = 0
        #: indices of the sub-groups updated during this backward and not undone
        self.stepped: set[int] = set()
        self._undo: dict[int, tuple[ShardTile, UndoRecord, list[Any] | None]] = {}
        self._ahead: list[Any] | None = None
        # sub-groups whose writes are in flight (each key on its own writer): (position in `order`, tile, writes)
        self._pending_writes: list[tuple[int, ShardTile, list[Any]]] = []
        self.active = True
        self.settled = False
        #: counters for tests and reports: sub-groups undone by `settle`/`undo_all`, and the sub-groups whose
        #: read (or read-ahead) was issued while the previous sub-group's writes were still in flight
        self.num_undone = 0
        self.num_reads_over_writes = 0

    def start(self) -> None:
        """Begin reading the first expected sub-group's master and state (overlaps the start of backward)."""
        if self.order and self.swapper.pipeline_read:
            self._ahead = self.swapper._issue_reads(self.order[0], 0, with_grad=False)

    def offer(self, tile: ShardTile, grad: torch.Tensor) -> bool:
        """Step `tile` now with `grad` (its complete fp32 gradient) if it is the next expected; else False."""
        if self.active and self.stop is not None and self.stop():
            self.active = False  # this step is skipped or clipped anyway: the rest waits for step()
        if not self.active or self.pos >= len(self.order) or self.order[self.pos] is not tile:
            self.active = False  # out of the recorded order: the rest waits for step()
            return False
        sw = self.swapper
        set_index = self.pos % sw.num_sets
        # The set this sub-group is read into was last used `num_sets` places back: its writes must have
        # landed. The previous sub-group's writes stay in flight while this one is read.
        self._settle_writes(before=self.pos - sw.num_sets + 1)
        if self._pending_writes and self._ahead is None:
            self.num_reads_over_writes += 1
        reads = self._ahead if self._ahead is not None else sw._issue_reads(tile, set_index, with_grad=False)
        sw._wait(sw.reader, "read", [r for r, _, _ in reads])
        self._ahead = None
        if sw.pipeline_read and self.pos + 1 < len(self.order):
            # The next sub-group's set is the one the previous sub-group's writes leave (with both pipelines:
            # `optimizer_swapper`'s module note): each buffer's read-ahead waits for that buffer's write only,
            # then the read-ahead overlaps this update and the backward of the layers before it.
            before = self.pos + 2 - sw.num_sets
            self.num_reads_over_writes += int(bool(self._pending_writes))
            self._ahead = sw._issue_reads(
                self.order[self.pos + 1],
                (self.pos + 1) % sw.num_sets,
                with_grad=False,
                before_read=lambda key: self._settle_writes(before=before, key=key),
            )
            self._settle_writes(before=before)
        sw._bind(tile, set_index, reads, with_grad=False)
        keys = sw._keys.get(tile.index)
        # The master and the swapped moments' pre-update values stay in the committed files; the rest is copied.
        elsewhere = [UndoRecord.VALUES, *(k for k, _ in keys or [])]
        record = UndoRecord(sw.optimizer, tile.master, tile.group_index, copy=True, elsewhere=elsewhere)
        tile.master.grad = grad
        self.step_fn(tile)
        tile.master.grad = None
        writes = sw._issue_writes(tile, sw.spare_slot(tile))
        self._undo[tile.index] = (tile, record, None if keys is None else list(keys))
        self._pending_writes.append((self.pos, tile, writes))
        if not sw.pipeline_write:  # its buffer set is needed again right away
            self._settle_writes()
        self.stepped.add(tile.index)
        self.pos += 1
        return True

    def _settle_writes(self, before: int | None = None, key: str | None = None) -> None:
        """Wait for the writes of the sub-groups at positions below `before` (None: all), oldest first; with
        `key`, for that key's writes only, leaving the sub-groups bound."""
        waiting = [w for w in self._pending_writes if before is None or w[0] < before]
        if key is not None:
            if waiting:  # a key's writer carries only these sub-groups' writes of it (the sets' rotation)
                self.swapper.wait_key_writers([x for _, _, writes in waiting for x in writes], key)
            return
        for entry in waiting:
            _, tile, writes = entry
            self.swapper.wait_key_writers(writes)
            self.swapper._unbind(tile, writes)
            self._pending_writes.remove(entry)

    def finish(self) -> None:
        """End of backward: the last write lands, a read-ahead nobody took is dropped."""
        self.active = False
        if self._ahead is not None:
            self._ahead = None
            self.swapper._wait(self.swapper.reader, "read", [])
        self._settle_writes()

    # ---------------------------------------------------------------- at the step
    def settle(self, outcome: StepOutcome) -> None:
        """Keep or undo every update of this backward, given the step's decision (the note above).

        Afterwards `stepped` holds the sub-groups whose update stands; `step()` updates the others.
        """
        self.finish()
        self.settled = True
        if not self.stepped:
            return
        if not outcome.applied or outcome.clip_coef != 1.0:
            why = "skipped step" if not outcome.applied else f"clipped gradients (coef {outcome.clip_coef:.4g})"
            self.undo(list(self.stepped), why)
        else:
            changed = [i for i in self.stepped if self._undo[i][1].hyper_changed(self.swapper.optimizer)]
            if changed and self.keep_grads:  # redone by step() from the gradients on disk
                self.undo(changed, "changed hyper-parameters")
            elif changed:
                logger.warning(
                    "NVMe offload: the hyper-parameters changed between the backward and step(); %d sub-groups "
                    "were updated during the backward with the old ones and keep that update",
                    len(changed),
                )
        for index in self.stepped:
            self.swapper.commit_slot(self._undo[index][0])
        self._undo.clear()

    def undo_all(self) -> None:
        """The gradients are dropped without a step (`zero_grad`): undo whatever was updated from them."""
        self.finish()
        if not self.settled:
            self.undo(list(self.stepped), "gradients dropped without a step")
            self.settled = True

    def undo(self, indices: list[int], why: str) -> None:
        """Undo the updates of the sub-groups `indices` (after `finish`): `step()` updates them instead."""
        self.finish()
        logger.debug("NVMe offload: undoing %d in-backward sub-group updates (%s)", len(indices), why)
        sw = self.swapper
        for index in sorted(indices):
            tile, record, keys = self._undo.pop(index)
            record.restore(sw.optimizer)
            if keys is None:
                sw._keys.pop(index, None)
            else:
                sw._keys[index] = keys
            _write_shards_from_master(tile, sw.read_master(tile))
            self.stepped.discard(index)
            self.num_undone += 1


def _write_shards_from_master(tile: ShardTile, master: torch.Tensor) -> None:
    """The tile's model-dtype shards from its (committed) fp32 master: the update wrote them too."""
    with torch.no_grad():
        flat = tile.shard16()
        if flat is not None:
            flat.copy_(master)
        else:
            write_shards(
                tile.params,
                [master[off : off + state_of(p).shard_numel] for p, off in zip(tile.params, tile.offsets, strict=True)],
            )


#: Left free on the swap disk (at least; or 1% of it) when deciding how many spare files may be created.
DISK_RESERVE_BYTES = 1 << 30


def free_swap_bytes(path: os.PathLike[str]) -> int:
    """Bytes this rank may still claim under `path`: the filesystem's free space less a reserve, split
    between the ranks of this host (each decides alone, against the same free space)."""
    usage = shutil.disk_usage(path)
    reserve = max(DISK_RESERVE_BYTES, usage.total // 100)
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE") or 1))
    return max(0, usage.free - reserve) // ranks_here


def fitting_on_disk(swapper: OptimizerSwapper, order: list[ShardTile]) -> list[ShardTile]:
    """The longest prefix of `order` whose spare files (`OptimizerSwapper.spare_bytes_needed`) fit in
    `free_swap_bytes`; says once, naming the key, how much more disk would let every sub-group in."""
    budget = free_swap_bytes(swapper.dir)
    needs = [swapper.spare_bytes_needed(tile) for tile in order]
    fits = 0
    while fits < len(order) and needs[fits] <= budget:
        budget -= needs[fits]
        fits += 1
    if fits < len(order) and not swapper.disk_limit_logged:
        swapper.disk_limit_logged = True
        logger.warning(
            "NVMe offload: updating a sub-group during the backward keeps a second copy of its fp32 master and "
            "optimizer state on disk; only %d of %d sub-groups' copies fit under "
            "zero_optimization.offload_optimizer.nvme_path (%s, %.1f GB free on the disk), the other %d are "
            "updated at step() (slower). %.1f GB more free space there lets every sub-group in.",
            fits,
            len(order),
            swapper.dir,
            shutil.disk_usage(swapper.dir).free / 1e9,
            len(order) - fits,
            sum(needs[fits:]) / 1e9,
        )
    return order[:fits]


def arm_eager_steps(zero: Any, boundary: bool) -> bool:
    """A backward of `zero` (a `DeepSpeedZeroOptimizer_Stage3`) starts: with the optimizer on NVMe, let it
    update sub-groups during this backward, speculatively (the module note), when it ends the accumulation
    window (`boundary`, the engine's hint), the loss scale is 1, a previous backward's completion order is
    known and never had a second gradient for a parameter, and (under an inf/nan check or clipping) the
    last step was applied unclipped: a skipped or clipped step tends to be followed by another (early
    training, a loss spike), whose updates would all be undone, so the next backward leaves the step to
    `step()`. Returns the boundary hint for the next backward (consumed: False)."""
    swapper = zero.optimizer_swapper
    if swapper is None or swapper.grads.eager is not None or zero.reducer.deferred:
        return False  # deferred: no gradient reaches the swapper during this backward
    order = swapper.grads.last_order
    if (
        boundary
        and zero.nvme_speculation
        and zero._last_step_clean
        and not zero.loss_scaler.dynamic
        and zero.loss_scaler.loss_scale == 1.0
        and not zero.reducer.saw_late
        and len(order) == sum(1 for t in zero.tiles if t.numel)
    ):
        order = fitting_on_disk(swapper, order)
        if not order:
            return False
        keep_grads = zero.clip_grad > 0
        if not keep_grads:
            swapper.release_grad_buffers()  # not needed while sub-groups are updated in backward
        swapper.grads.eager = EagerSteps(
            swapper, order, zero._step_one, keep_grads=keep_grads, stop=lambda: step_known_to_change(zero)
        )
        swapper.grads.eager.start()
    return False


def step_known_to_change(zero: Any) -> bool:
    """Whether this rank's gradients so far already show the step will be skipped (an inf/nan under the
    check) or clipped (their norm alone is above `gradient_clipping`, so the global norm is too). Only a
    hint to stop updating during the backward; `step()` decides."""
    grads = zero.optimizer_swapper.grads
    stats = grads.stats()
    if zero.check_overflow and stats.nonfinite:
        return True
    if zero.clip_grad > 0 and grads.norm_type == 2.0 and stats.norm_term > 0:
        return math.sqrt(stats.norm_term) > zero.clip_grad * (1.0 + 1e-3) + 1e-6
    return False
