"""`PipelineExecutor`: runs a schedule's instruction stream over a `PipelineModule` on this stage."""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import record_function

import ds_comm
from ds_pipe import schedule as sched
from ds_pipe._grad_reduce import allreduce_mean_grads
from ds_pipe._grid import PipelineParallelGrid
from ds_pipe._module import PipelineModule
from ds_pipe._p2p import StageP2P, as_tuple

logger = logging.getLogger(__name__)

__all__ = ["PipelineError", "PipelineExecutor"]


class PipelineError(Exception):
    """A method pipeline mode does not offer (an engine raises it from forward/backward/step)."""


@dataclasses.dataclass
class _Buffer:
    """What one pipe buffer holds for its current micro-batch."""

    inputs: Any = None
    labels: Any = None
    outputs: Any = None
    loss: torch.Tensor | None = None
    grads: list[torch.Tensor] | None = None


def _to_device(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_to_device(v, device) for v in value)
    return value


def _mean(values: list[Any]) -> Any:
    """Element-wise mean of per-micro-batch outputs (tensors, or tuples of tensors)."""
    if isinstance(values[0], (tuple, list)):
        return tuple(_mean([v[i] for v in values]) for i in range(len(values[0])))
    return torch.stack([v.detach().float() for v in values]).mean(0).to(values[0].dtype)


class PipelineExecutor:
    """Runs 1F1B training and pipelined inference for one stage of a `PipelineModule`, with no engine.

    Every rank of the topology builds one executor and calls `train_batch` / `eval_batch` together.
    A training batch runs `TrainSchedule(micro_batches, stages, stage)`: micro-batch losses are
    divided by `micro_batches` (gradients are the mean over micro-batches), tied weights' gradients
    are summed over their tie groups, gradients are averaged over the data-parallel group, then
    `optimizer_step()` runs. Gradients are zeroed (set to None) at the start of each batch.

    Args:
        module: this stage's `PipelineModule`.
        micro_batches: micro-batches per batch (DeepSpeed: gradient_accumulation_steps), >= 1.
        optimizer_step: called once per training batch after gradient reduction (e.g. clip, step,
            scheduler); None leaves the reduced gradients in `.grad` for the caller.
        grid: the grid; default `module.mpu()`.
        loss_fn: `loss_fn(outputs, labels)` on the last stage; default `module.loss_fn` (None: the
            last layer's output is the loss).
        reduce_grads: replaces the data-parallel gradient averaging (e.g. a ZeRO optimizer's own
            reduction); called once per batch after tied-gradient reduction.
        scale_loss: applied to each micro-batch loss (already divided by `micro_batches`) before
            backward, e.g. fp16 loss scaling. The reported loss is unscaled.
        batch_fn: applied to every batch drawn from the data iterator (DeepSpeed's `set_batch_fn`).
        pipe_partitioned: with tensor parallelism, send activation slices (`pipeline.pipe_partitioned`).
        grad_partitioned: likewise for gradients (`pipeline.grad_partitioned`).
        device: where data and received tensors go; default the accelerator's current device.
        broadcast_parameters: copy every parameter and buffer from data-parallel rank 0 to the other
            replicas of this stage now (a broadcast on the data-parallel group), so replicas start
            equal; an engine that already did so can pass False.

    Each batch from the data iterator is `(inputs, labels)`; the first stage uses `inputs`, the last
    `labels`, other stages do not read it. `inputs` is a tensor or a tuple of tensors.
    """

    def __init__(
        self,
        module: PipelineModule,
        *,
        micro_batches: int,
        optimizer_step: Callable[[], None] | None = None,
        grid: PipelineParallelGrid | None = None,
        loss_fn: Callable[..., torch.Tensor] | None = None,
        reduce_grads: Callable[[], None] | None = None,
        scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
        batch_fn: Callable[[Any], Any] | None = None,
        pipe_partitioned: bool = True,
        grad_partitioned: bool = True,
        device: torch.device | None = None,
        broadcast_parameters: bool = True,
    ) -> None:
        if not isinstance(module, PipelineModule):
            raise TypeError(f"PipelineExecutor: module must be a PipelineModule, got {type(module).__name__}")
        self.module = module
        self.grid = grid if grid is not None else module.mpu()
        self.set_micro_batches(micro_batches)
        self.optimizer_step = optimizer_step
        self.loss_fn = loss_fn if loss_fn is not None else module.loss_fn
        self.reduce_grads = reduce_grads
        self.scale_loss = scale_loss
        self.batch_fn = batch_fn
        self.device = device if device is not None else ds_comm.get_accelerator().device()
        self.stage_id = self.grid.get_stage_id()
        self.num_stages = self.grid.get_pipe_parallel_world_size()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.num_stages - 1
        self.p2p = StageP2P(
            self.grid,
            self.device,
            dynamic_shape=module.dynamic_shape,
            pipe_partitioned=pipe_partitioned,
            grad_partitioned=grad_partitioned,
        )
        self.data_iterator: Iterator[Any] | None = None
        if broadcast_parameters and self.grid.get_data_parallel_world_size() > 1:
            src = self.grid.dp_group[0]
            for tensor in [*module.parameters(), *module.buffers()]:
                ds_comm.broadcast(tensor.data, src=src, group=self.grid.get_data_parallel_group())
        self._timings: dict[str, float] = defaultdict(float)
        self._schedules: dict[tuple[type[sched.PipeSchedule], int], tuple[int, list[list[Any]]]] = {}
        self._handlers: dict[type[sched.PipeInstruction], Callable[[Any], None]] = {
            sched.LoadMicroBatch: self._load_micro_batch,
            sched.ForwardPass: self._forward_pass,
            sched.BackwardPass: self._backward_pass,
            sched.SendActivation: self._send_activation,
            sched.RecvActivation: self._recv_activation,
            sched.SendGrad: self._send_grad,
            sched.RecvGrad: self._recv_grad,
            sched.ReduceTiedGrads: self._reduce_tied_grads,
            sched.ReduceGrads: self._reduce_grads,
            sched.OptimizerStep: self._optimizer_step,
        }

    # Configuration
    def set_micro_batches(self, micro_batches: int) -> None:
        """Change the micro-batches per batch (e.g. after the engine changes the batch size)."""
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
            raise ValueError(f"PipelineExecutor: micro_batches must be an int >= 1, got {micro_batches!r}")
        self.micro_batches = micro_batches

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """The iterator `train_batch()` / `eval_batch()` read when called without one."""
        self.data_iterator = iterator

    def reset_activation_shape(self) -> None:
        """Exchange activation shapes again on the next batch (call on every stage together)."""
        self.p2p.reset_activation_shape()

    def timings(self) -> dict[str, float]:
        """Seconds spent per instruction name during the last batch, plus `batch` (its wall time)."""
        return dict(self._timings)

    # Batches
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Run one training batch; returns the mean loss (averaged over data-parallel replicas) on every stage.

        Collectives: p2p with the neighbouring stages (the loss too, handed back from the last stage:
        [Note: the loss walks back]); all-reduce over tie groups and the data-parallel group.

        Raises:
            RuntimeError: gradients are disabled (`torch.no_grad()`).
            ValueError: the first or last stage has no data iterator.
        """
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        self.module.train()
        self.module.zero_grad(set_to_none=True)
        losses = self._run(self._schedule(sched.TrainSchedule, self.micro_batches), data_iter, mode="train")
        mean = torch.stack(losses).float().mean() if losses else None
        return self._share_loss(mean)

    def eval_batch(
        self,
        data_iter: Iterator[Any] | None = None,
        return_logits: bool = False,
        compute_loss: bool = True,
        reduce_output: str | None = "avg",
        bcast_loss: bool = True,
        num_micro_batches: int | None = None,
    ) -> Any:
        """Run the forward of one batch with `InferenceSchedule` under `torch.no_grad()`.

        Args:
            data_iter: yields `(inputs, labels)` micro-batches (first and last stage).
            return_logits: also return the last stage's outputs, one per micro-batch (None elsewhere).
            compute_loss: apply the loss function; otherwise the "loss" is the last stage's output.
            reduce_output: "avg" for the mean over micro-batches (and data-parallel replicas), None
                for the list of per-micro-batch values.
            bcast_loss: send the result from the last stage to every stage (else None elsewhere).
            num_micro_batches: micro-batches in this batch; default `micro_batches`.

        Returns:
            The result, or `(result, logits)` with `return_logits`.
        """
        if reduce_output not in ("avg", None):
            raise ValueError(f"eval_batch: reduce_output must be 'avg' or None, got {reduce_output!r}")
        num = num_micro_batches if num_micro_batches is not None else self.micro_batches
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                self._compute_loss, self._keep_logits, self._logits = compute_loss, return_logits, []
                results = self._run(self._schedule(sched.InferenceSchedule, num), data_iter, mode="eval")
        finally:
            self.module.train(was_training)
        result: Any = None
        if self.is_last_stage:
            result = _mean(results) if reduce_output == "avg" else results
            if reduce_output == "avg":
                result = self._dp_mean(result)
        if bcast_loss and self.num_stages > 1:
            result = self._broadcast_object(result)
        logits = self._logits if self.is_last_stage else None
        return (result, logits) if return_logits else result

    # Schedule execution
    def _schedule(self, kind: type[sched.PipeSchedule], micro_batches: int) -> tuple[int, list[list[Any]]]:
        """(buffer count, steps) of a schedule, built once per kind and micro-batch count."""
        key = (kind, micro_batches)
        if key not in self._schedules:
            schedule = kind(micro_batches, self.num_stages, self.stage_id)
            # A step's sends refer to the previous step's results and never block: issue them before the
            # step's receives, so a neighbour waiting for them is not held up by our own wait.
            sends = (sched.SendActivation, sched.SendGrad)
            steps = [
                [c for c in step if isinstance(c, sends)] + [c for c in step if not isinstance(c, sends)]
                for step in schedule
            ]
            self._schedules[key] = (schedule.num_pipe_buffers(), steps)
        return self._schedules[key]

    def _run(self, schedule: tuple[int, list[list[Any]]], data_iter: Iterator[Any] | None, mode: str) -> list[Any]:
        iterator = data_iter if data_iter is not None else self.data_iterator
        if iterator is None and (self.is_first_stage or self.is_last_stage):
            which = "first" if self.is_first_stage else "last"
            raise ValueError(
                f"stage {self.stage_id} (the {which} stage) reads data: pass data_iter=... or call "
                "set_dataiterator() first"
            )
        self._iterator, self._mode = iterator, mode
        num_buffers, steps = schedule
        self._buffers = [_Buffer() for _ in range(num_buffers)]
        flat = [type(c) for step in steps for c in step]
        self._recvs_left = {kind: flat.count(kind) for kind in (sched.RecvActivation, sched.RecvGrad)}
        self._results: list[Any] = []
        self._timings.clear()
        self.p2p.mode = mode
        # Profiler labels cost ~10 us per instruction: only pay for them while a profiler is recording.
        label = torch.autograd._profiler_enabled()
        start = time.perf_counter()
        try:
            for step in steps:
                for instruction in step:
                    began = time.perf_counter()
                    if label:
                        with record_function(f"ds_pipe::{instruction.name}"):
                            self._handlers[type(instruction)](instruction)
                    else:
                        self._handlers[type(instruction)](instruction)
                    self._timings[instruction.name] += time.perf_counter() - began
            self.p2p.finish_batch()
        finally:
            self._buffers, self._iterator = [], None
        self._timings["batch"] = time.perf_counter() - start
        return self._results

    def _load_micro_batch(self, instruction: sched.LoadMicroBatch) -> None:
        assert self._iterator is not None
        batch = next(self._iterator)
        if self.batch_fn is not None:
            batch = self.batch_fn(batch)
        if not isinstance(batch, (tuple, list)) or len(batch) != 2:
            raise TypeError(
                f"each batch from data_iter must be an (inputs, labels) pair, got {type(batch).__name__}"
                + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else "")
            )
        buffer = self._buffers[instruction.buffer_id]
        if self.is_first_stage:
            inputs = batch[0]
            buffer.inputs = _to_device(tuple(inputs) if isinstance(inputs, list) else inputs, self.device)
        if self.is_last_stage:
            buffer.labels = _to_device(batch[1], self.device)

    def _forward_pass(self, instruction: sched.ForwardPass) -> None:
        buffer = self._buffers[instruction.buffer_id]
        outputs = self.module(buffer.inputs)
        if isinstance(outputs, list):
            outputs = tuple(outputs)
        if not self.is_last_stage:
            buffer.outputs = outputs
            if self._mode == "eval":
                buffer.inputs = None
            return
        if self._mode == "eval":
            if self._keep_logits:
                self._logits.append(outputs)
            use_loss = self._compute_loss and self.loss_fn is not None
            self._results.append(self.loss_fn(outputs, buffer.labels) if use_loss else outputs)  # type: ignore[misc]
            buffer.inputs = buffer.labels = None
            return
        loss = self.loss_fn(outputs, buffer.labels) if self.loss_fn is not None else outputs
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shown = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(
                f"the loss on the last stage must be a scalar tensor, got {shown}; pass a loss_fn "
                "that reduces (e.g. mean) or make the last layer return the loss"
            )
        loss = loss.reshape(())  # a one-element output ((1, 1) from a last Linear(h, 1)) is a loss too, as in DeepSpeed
        buffer.loss = loss
        buffer.labels = None
        self._results.append(loss.detach())

    def _backward_pass(self, instruction: sched.BackwardPass) -> None:
        buffer = self._buffers[instruction.buffer_id]
        if self.is_last_stage:
            assert buffer.loss is not None
            loss = buffer.loss / self.micro_batches
            if self.scale_loss is not None:
                loss = self.scale_loss(loss)
            loss.backward()
        else:
            outputs = [o for o in as_tuple(buffer.outputs) if o.requires_grad]
            if outputs:
                torch.autograd.backward(outputs, grad_tensors=buffer.grads)
        buffer.outputs = buffer.loss = buffer.grads = None
        if self.is_first_stage:
            buffer.inputs = None

    def _send_activation(self, instruction: sched.SendActivation) -> None:
        buffer = self._buffers[instruction.buffer_id]
        self.p2p.send_activations(buffer.outputs)
        if self._mode == "eval":
            buffer.outputs = None

    def _recv_activation(self, instruction: sched.RecvActivation) -> None:
        self._recvs_left[sched.RecvActivation] -= 1
        more = self._recvs_left[sched.RecvActivation] > 0
        self._buffers[instruction.buffer_id].inputs = self.p2p.recv_activations(prefetch_next=more)

    def _send_grad(self, instruction: sched.SendGrad) -> None:
        buffer = self._buffers[instruction.buffer_id]
        self.p2p.send_grads(buffer.inputs)
        buffer.inputs = None

    def _recv_grad(self, instruction: sched.RecvGrad) -> None:
        buffer = self._buffers[instruction.buffer_id]
        self._recvs_left[sched.RecvGrad] -= 1
        buffer.grads = self.p2p.recv_grads(buffer.outputs, prefetch_next=self._recvs_left[sched.RecvGrad] > 0)

    def _reduce_tied_grads(self, instruction: sched.ReduceTiedGrads) -> None:
        self.module.allreduce_tied_weight_gradients()

    def _reduce_grads(self, instruction: sched.ReduceGrads) -> None:
        if self.reduce_grads is not None:
            self.reduce_grads()
        elif self.grid.get_data_parallel_world_size() > 1:
            allreduce_mean_grads(
                self.module.parameters(), self.grid.get_data_parallel_group(), self.grid.get_data_parallel_world_size()
            )

    def _optimizer_step(self, instruction: sched.OptimizerStep) -> None:
        if self.optimizer_step is not None:
            self.optimizer_step()

    # Results
    def _dp_mean(self, value: Any) -> Any:
        world = self.grid.get_data_parallel_world_size()
        if world == 1:
            return value
        if isinstance(value, tuple):
            return tuple(self._dp_mean(v) for v in value)
        if not value.is_floating_point():
            return value
        total = value.detach().float().clone()
        ds_comm.all_reduce(total, group=self.grid.get_data_parallel_group())
        return (total / world).to(value.dtype)

    def _share_loss(self, mean: torch.Tensor | None) -> torch.Tensor:
        """The last stage's mean loss, averaged over data-parallel replicas, on every stage.

        [Note: the loss walks back] Each stage receives it from the next stage and hands it to the
        previous one, point to point, instead of a broadcast over the pipe group: 1F1B's drain ends
        the stages in that very order (the last stage first, the first stage last), so every stage
        finds the loss already sent when it gets there. A broadcast made the first stage, whose end
        is the batch's end, run a gloo collective there: 0.7-1.0 ms from its last instruction to its
        return on this 2-CPU host's sleep-model pipeline (4 stages), 0.2 ms with the walk through
        the neighbours' shared-memory ring.
        """
        if self.is_last_stage:
            assert mean is not None
            loss = self._dp_mean(mean.detach())
        else:
            loss = torch.empty((), dtype=torch.float32, device=self.device)
            assert self.p2p.next_rank is not None
            ds_comm.recv(loss, self.p2p.next_rank)
        if not self.is_first_stage:
            assert self.p2p.prev_rank is not None
            ds_comm.send(loss, self.p2p.prev_rank)
        return loss

    def _broadcast_object(self, value: Any) -> Any:
        """The last stage's `value` on every stage: pickled bytes in two tensor broadcasts.

        [Note: why not broadcast_object_list] torch's object collectives decode through numpy,
        which is not a torch dependency (a venv without it fails there).
        """
        src, group = self.grid.stage_to_global(self.num_stages - 1), self.grid.get_pipe_parallel_group()
        payload = torch.empty(0, dtype=torch.uint8)
        if self.is_last_stage:
            payload = torch.frombuffer(
                bytearray(pickle.dumps(_to_device(value, torch.device("cpu")))), dtype=torch.uint8
            )
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=self.device)
        ds_comm.broadcast(size, src=src, group=group)
        buffer = (
            payload.to(self.device)
            if self.is_last_stage
            else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        )
        ds_comm.broadcast(buffer, src=src, group=group)
        if self.is_last_stage:
            return value
        return _to_device(pickle.loads(bytes(buffer.cpu().tolist())), self.device)
