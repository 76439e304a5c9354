"""Pipeline schedules as instruction streams (DeepSpeed's names and buffer ids).

A schedule is built per stage: `TrainSchedule(micro_batches, stages, stage_id)` yields, step by
step, the list of instructions that stage runs. Every stage runs the same number of steps in lock
step, so the sends of one step meet the receives of its neighbour in the same step. The executor
(`PipelineExecutor`) maps each instruction class to an action; any other driver can too.

[Note: 1F1B timing] With `p` stages and `m` micro-batches a training batch has `2 (m + p - 1)`
steps. Stage `s` runs the forward of micro-batch `k` at step `2k + s` and its backward at step
`2k + 2p - 1 - s`: forward and backward steps alternate, the first `p - s` forwards run before the
first backward (warm-up), then one forward and one backward alternate (steady state), and the last
backwards drain (cool-down). Results move at the start of the step after they are computed: a
forward step first sends back the gradient of the previous (backward) step and receives its
input; a backward step first receives its output gradient and then sends on the previous
(forward) step's activation. The matching peer step has the other kind, so sends and receives
pair up in the same order on both sides.

Buffers: micro-batch `k` lives in buffer `k % num_pipe_buffers()` from its load/receive until its
gradient is sent back. At most `min(p - s, m)` micro-batches are in flight on stage `s`; like
DeepSpeed we allocate at least 2 buffer ids (buffer ids are names, not memory: only in-flight
micro-batches hold activations).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

__all__ = [
    "BackwardPass",
    "BufferOpInstruction",
    "DataParallelSchedule",
    "ForwardPass",
    "InferenceSchedule",
    "LoadMicroBatch",
    "OptimizerStep",
    "PipeInstruction",
    "PipeSchedule",
    "RecvActivation",
    "RecvGrad",
    "ReduceGrads",
    "ReduceTiedGrads",
    "SendActivation",
    "SendGrad",
    "TrainSchedule",
]


class PipeInstruction:
    """One action of a schedule; keyword arguments become attributes (e.g. `buffer_id`)."""

    def __init__(self, **kwargs: Any) -> None:
        self.name = type(self).__name__
        self.kwargs = kwargs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items())
        return f"{self.name}({args})"

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self.kwargs == other.kwargs

    def __hash__(self) -> int:
        return hash((self.name, tuple(sorted(self.kwargs.items()))))


class OptimizerStep(PipeInstruction):
    """Apply the optimizer to the accumulated (and reduced) gradients."""


class ReduceGrads(PipeInstruction):
    """Average gradients over the data-parallel group."""


class ReduceTiedGrads(PipeInstruction):
    """Sum the gradients of tied weights over the stages that share them."""


class BufferOpInstruction(PipeInstruction):
    """An instruction on one pipe buffer."""

    def __init__(self, buffer_id: int, **kwargs: Any) -> None:
        super().__init__(buffer_id=buffer_id, **kwargs)


class LoadMicroBatch(BufferOpInstruction):
    """Take the next micro-batch from the data iterator: inputs on the first stage, labels on the last."""


class ForwardPass(BufferOpInstruction):
    """Run this stage's layers on the buffer's inputs (and the loss on the last stage)."""


class BackwardPass(BufferOpInstruction):
    """Back-propagate the buffer's outputs with the received gradients (the loss on the last stage)."""


class SendActivation(BufferOpInstruction):
    """Send the buffer's outputs to the next stage."""


class RecvActivation(BufferOpInstruction):
    """Receive the buffer's inputs from the previous stage."""


class SendGrad(BufferOpInstruction):
    """Send the gradients of the buffer's inputs to the previous stage."""


class RecvGrad(BufferOpInstruction):
    """Receive the gradients of the buffer's outputs from the next stage."""


class PipeSchedule(abc.ABC):
    """The instruction stream of one stage for one batch of `micro_batches` micro-batches.

    Args:
        micro_batches: micro-batches per batch, >= 1.
        stages: pipeline stages, >= 1.
        stage_id: this stage, in `[0, stages)`.

    Raises:
        ValueError: any argument out of range.
    """

    def __init__(self, micro_batches: int, stages: int, stage_id: int) -> None:
        for name, value, low in (("micro_batches", micro_batches, 1), ("stages", stages, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"{type(self).__name__}: {name} must be an int >= {low}, got {value!r}")
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or not 0 <= stage_id < stages:
            raise ValueError(f"{type(self).__name__}: stage_id must be in [0, {stages}), got {stage_id!r}")
        self.micro_batches = micro_batches
        self.stages = stages
        self.stage_id = stage_id
        self.prev_stage = stage_id - 1
        self.next_stage = stage_id + 1

    @abc.abstractmethod
    def steps(self) -> Iterator[list[PipeInstruction]]:
        """Yield the instructions of each step, in order."""

    @abc.abstractmethod
    def num_pipe_buffers(self) -> int:
        """How many buffer ids the stream uses."""

    @property
    def stage(self) -> int:
        return self.stage_id

    @property
    def num_stages(self) -> int:
        return self.stages

    @property
    def num_micro_batches(self) -> int:
        return self.micro_batches

    @property
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage_id == self.stages - 1

    def _valid_micro_batch(self, micro_batch_id: int | None) -> bool:
        return micro_batch_id is not None and 0 <= micro_batch_id < self.micro_batches

    def _buffer_idx(self, micro_batch_id: int) -> int:
        return micro_batch_id % self.num_pipe_buffers()

    def __iter__(self) -> Iterator[list[PipeInstruction]]:
        return self.steps()

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(micro_batches={self.micro_batches}, stages={self.stages}, stage_id={self.stage_id})"


class TrainSchedule(PipeSchedule):
    """1F1B training: warm-up forwards, alternating forward/backward, cool-down backwards, then the step.

    The last step also issues `ReduceTiedGrads`, `ReduceGrads` and `OptimizerStep`. See the module
    note for the timing.
    """

    def steps(self) -> Iterator[list[PipeInstruction]]:
        total_steps = 2 * (self.micro_batches + self.stages - 1)
        prev_micro_batch: int | None = None
        for step_id in range(total_steps):
            micro_batch, is_forward = self._slot(step_id)
            cmds: list[PipeInstruction] = []
            curr_valid = self._valid_micro_batch(micro_batch)
            prev_valid = self._valid_micro_batch(prev_micro_batch)
            if is_forward:
                if prev_valid and not self.is_first_stage:
                    cmds.append(SendGrad(self._buffer_idx(prev_micro_batch)))  # type: ignore[arg-type]
                if curr_valid and not self.is_first_stage:
                    cmds.append(RecvActivation(self._buffer_idx(micro_batch)))
            else:
                if curr_valid and not self.is_last_stage:
                    cmds.append(RecvGrad(self._buffer_idx(micro_batch)))
                if prev_valid and not self.is_last_stage:
                    cmds.append(SendActivation(self._buffer_idx(prev_micro_batch)))  # type: ignore[arg-type]
            if is_forward and curr_valid and (self.is_first_stage or self.is_last_stage):
                cmds.append(LoadMicroBatch(self._buffer_idx(micro_batch)))
            if curr_valid:
                op = ForwardPass if is_forward else BackwardPass
                cmds.append(op(self._buffer_idx(micro_batch)))
            if step_id == total_steps - 1:
                cmds.extend([ReduceTiedGrads(), ReduceGrads(), OptimizerStep()])
            prev_micro_batch = micro_batch
            yield cmds

    def _slot(self, step_id: int) -> tuple[int, bool]:
        """(micro-batch, is_forward) of a step; the micro-batch may be out of range (an idle slot)."""
        if (step_id - self.stage_id) % 2 == 0:
            return (step_id - self.stage_id) // 2, True
        return (step_id - 2 * self.stages + 1 + self.stage_id) // 2, False

    def num_pipe_buffers(self) -> int:
        """`max(2, min(stages - stage_id, micro_batches))`: the micro-batches in flight (at least 2 ids)."""
        return max(2, min(self.stages - self.stage_id, self.micro_batches))


class InferenceSchedule(PipeSchedule):
    """Forward only: stage `s` runs micro-batch `k` at step `k + s`, double-buffered, `m + p - 1` steps.

    Even stages send the previous step's output before receiving; odd stages receive first, so
    neighbours always pair a send with a receive.
    """

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches + self.stages - 1):
            micro_batch = step_id - self.stage_id
            even = self.stage_id % 2 == 0
            recv_buf = step_id % 2 if even else (step_id + 1) % 2
            send_buf = (step_id + 1) % 2 if even else step_id % 2
            cmds: list[PipeInstruction] = []
            if (self.is_first_stage or self.is_last_stage) and self._valid_micro_batch(micro_batch):
                cmds.append(LoadMicroBatch(recv_buf))
            send = (not self.is_last_stage) and self._valid_micro_batch(micro_batch - 1)
            recv = (not self.is_first_stage) and self._valid_micro_batch(micro_batch)
            if even:
                cmds += [SendActivation(send_buf)] * send + [RecvActivation(recv_buf)] * recv
            else:
                cmds += [RecvActivation(recv_buf)] * recv + [SendActivation(send_buf)] * send
            if self._valid_micro_batch(micro_batch):
                cmds.append(ForwardPass(recv_buf))
            yield cmds

    def num_pipe_buffers(self) -> int:
        """Two: one being received into while the other is sent from."""
        return 2


class DataParallelSchedule(PipeSchedule):
    """One stage, plain gradient accumulation: load, forward, backward per micro-batch, then the step."""

    def steps(self) -> Iterator[list[PipeInstruction]]:
        for step_id in range(self.micro_batches):
            cmds: list[PipeInstruction] = [LoadMicroBatch(0), ForwardPass(0), BackwardPass(0)]
            if step_id == self.micro_batches - 1:
                cmds.extend([ReduceGrads(), OptimizerStep()])
            yield cmds

    def num_pipe_buffers(self) -> int:
        return 1
