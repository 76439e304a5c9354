"""Schedules: simulated execution for all stages <= 8 and micro-batches <= 16.

Each stage runs its instruction stream with *blocking* (rendezvous) sends, the strictest
semantics: a send completes only together with the neighbour's matching receive. The simulator
checks that every send meets the matching receive (same direction, same micro-batch), that no
stage deadlocks, that data flows correctly (forward after its input, backward after its output
gradient, a buffer is reused only once its micro-batch is finished) and that every micro-batch is
forwarded and back-propagated exactly once per stage, followed by one optimizer step.
"""

from __future__ import annotations

import dataclasses

import pytest

from ds_pipe.schedule import (
    BackwardPass,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    PipeSchedule,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)


@dataclasses.dataclass
class Slot:
    micro_batch: int
    have_input: bool = False
    have_labels: bool = False
    forward: bool = False
    grad_in: bool = False
    backward: bool = False
    sent_act: bool = False
    sent_grad: bool = False


class Stage:
    def __init__(self, schedule: PipeSchedule, train: bool) -> None:
        self.s, self.p, self.m, self.train = schedule.stage_id, schedule.stages, schedule.micro_batches, train
        self.program = [cmd for step in schedule for cmd in step]
        self.pc = 0
        self.buffers: dict[int, Slot] = {}
        self.next_in = 0  # next micro-batch whose input arrives (load or receive)
        self.next_label = 0
        self.labels: dict[int, int] = {}  # buffer -> micro-batch whose labels arrived before its input
        self.forwards: list[int] = []
        self.backwards: list[int] = []
        self.tail: list[str] = []

    @property
    def first(self) -> bool:
        return self.s == 0

    @property
    def last(self) -> bool:
        return self.s == self.p - 1

    def current(self) -> PipeInstruction | None:
        return self.program[self.pc] if self.pc < len(self.program) else None

    def finished(self, slot: Slot) -> bool:
        if self.train:
            return slot.backward and (self.first or slot.sent_grad)
        return slot.forward and (self.last or slot.sent_act)

    def new_input(self, buffer_id: int, micro_batch: int) -> None:
        old = self.buffers.get(buffer_id)
        assert old is None or self.finished(old), f"stage {self.s} overwrote buffer {buffer_id} holding {old}"
        assert micro_batch == self.next_in, f"stage {self.s} got micro-batch {micro_batch}, expected {self.next_in}"
        self.buffers[buffer_id] = Slot(micro_batch, have_input=True)
        self.next_in += 1
        if self.labels.get(buffer_id) == micro_batch:
            self.buffers[buffer_id].have_labels = True
            del self.labels[buffer_id]

    def local(self, cmd: PipeInstruction) -> None:
        assert not self.tail or isinstance(cmd, (ReduceTiedGrads, ReduceGrads, OptimizerStep)), "work after the step"
        if isinstance(cmd, LoadMicroBatch):
            if self.first:
                self.new_input(cmd.buffer_id, self.next_in)
            if self.last:
                slot = self.buffers.get(cmd.buffer_id)
                if slot is not None and slot.micro_batch == self.next_label and not slot.have_labels:
                    slot.have_labels = True
                else:  # labels first (the inference schedule loads before it receives)
                    assert cmd.buffer_id not in self.labels
                    self.labels[cmd.buffer_id] = self.next_label
                self.next_label += 1
        elif isinstance(cmd, ForwardPass):
            slot = self.buffers[cmd.buffer_id]
            assert slot.have_input and not slot.forward and (slot.have_labels or not self.last)
            slot.forward = True
            self.forwards.append(slot.micro_batch)
        elif isinstance(cmd, BackwardPass):
            slot = self.buffers[cmd.buffer_id]
            assert slot.forward and not slot.backward and (slot.grad_in or self.last)
            slot.backward = True
            self.backwards.append(slot.micro_batch)
        else:
            self.tail.append(cmd.name)


def _rendezvous(stages: list[Stage]) -> bool:
    """Complete one matching send/receive pair if any; True if progress was made."""
    for st in stages:
        cmd = st.current()
        if isinstance(cmd, SendActivation):
            peer = stages[st.s + 1]
            if isinstance(peer.current(), RecvActivation):
                slot = st.buffers[cmd.buffer_id]
                assert slot.forward and not slot.sent_act
                slot.sent_act = True
                peer.new_input(peer.current().buffer_id, slot.micro_batch)  # type: ignore[union-attr]
                st.pc, peer.pc = st.pc + 1, peer.pc + 1
                return True
        if isinstance(cmd, SendGrad):
            peer = stages[st.s - 1]
            if isinstance(peer.current(), RecvGrad):
                slot = st.buffers[cmd.buffer_id]
                assert slot.backward and not slot.sent_grad
                slot.sent_grad = True
                target = peer.buffers[peer.current().buffer_id]  # type: ignore[union-attr]
                assert target.micro_batch == slot.micro_batch and target.forward and not target.grad_in
                target.grad_in = True
                st.pc, peer.pc = st.pc + 1, peer.pc + 1
                return True
    return False


def simulate(make: type[PipeSchedule], stages: int, micro_batches: int) -> list[Stage]:
    train = make is TrainSchedule
    sims = [Stage(make(micro_batches, stages, s), train) for s in range(stages)]
    comm = (SendActivation, RecvActivation, SendGrad, RecvGrad)
    while any(st.current() is not None for st in sims):
        progressed = False
        for st in sims:
            while st.current() is not None and not isinstance(st.current(), comm):
                st.local(st.current())  # type: ignore[arg-type]
                st.pc += 1
                progressed = True
        progressed = _rendezvous(sims) or progressed
        if not progressed:
            blocked = {st.s: repr(st.current()) for st in sims if st.current() is not None}
            raise AssertionError(f"deadlock with {stages} stages, {micro_batches} micro-batches: {blocked}")
    return sims


@pytest.mark.parametrize("stages", range(1, 9))
def test_train_schedule_runs_without_deadlock(stages: int) -> None:
    for micro_batches in range(1, 17):
        for st in simulate(TrainSchedule, stages, micro_batches):
            assert st.forwards == list(range(micro_batches)), (stages, micro_batches, st.s)
            assert st.backwards == list(range(micro_batches)), (stages, micro_batches, st.s)
            assert st.tail == ["ReduceTiedGrads", "ReduceGrads", "OptimizerStep"]
            assert all(st.finished(slot) for slot in st.buffers.values())
            in_flight = max(st.forwards.index(k) - st.backwards.index(k) for k in range(micro_batches))
            assert in_flight >= 0


@pytest.mark.parametrize("stages", range(1, 9))
def test_inference_schedule_runs_without_deadlock(stages: int) -> None:
    for micro_batches in range(1, 17):
        for st in simulate(InferenceSchedule, stages, micro_batches):
            assert st.forwards == list(range(micro_batches)) and st.backwards == [] and st.tail == []
            assert all(st.finished(slot) for slot in st.buffers.values())


def test_simulator_catches_a_broken_schedule() -> None:
    class Swapped(TrainSchedule):
        """Receives the activation before sending the gradient: the neighbours wait on each other."""

        def steps(self):  # type: ignore[no-untyped-def]
            for cmds in super().steps():
                sends = [c for c in cmds if isinstance(c, SendGrad)]
                yield (
                    [c for c in cmds if not isinstance(c, SendGrad)][:1]
                    + sends
                    + [c for c in cmds if not isinstance(c, SendGrad)][1:]
                )

    with pytest.raises(AssertionError, match="deadlock"):
        simulate(Swapped, 2, 4)  # type: ignore[arg-type]
