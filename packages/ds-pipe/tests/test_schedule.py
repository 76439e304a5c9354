"""Schedules: the exact instruction stream of every stage for small (stages, micro-batches) cases."""

from __future__ import annotations

import pytest

from ds_pipe.schedule import (
    BackwardPass,
    DataParallelSchedule,
    ForwardPass,
    InferenceSchedule,
    LoadMicroBatch,
    OptimizerStep,
    PipeInstruction,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    TrainSchedule,
)

CODES: dict[str, type[PipeInstruction]] = {
    "L": LoadMicroBatch,
    "F": ForwardPass,
    "B": BackwardPass,
    "SA": SendActivation,
    "RA": RecvActivation,
    "SG": SendGrad,
    "RG": RecvGrad,
    "RT": ReduceTiedGrads,
    "RD": ReduceGrads,
    "OS": OptimizerStep,
}


def parse(text: str) -> list[list[PipeInstruction]]:
    """'L0 F0 | SA0 | ...' -> steps of instructions (letters = type, digits = buffer id)."""
    steps = []
    for step in text.split("|"):
        cmds: list[PipeInstruction] = []
        for token in step.split():
            name = token.rstrip("0123456789")
            digits = token[len(name) :]
            cmds.append(CODES[name](int(digits)) if digits else CODES[name]())
        steps.append(cmds)
    return steps


# Hand-checked against the 1F1B timing (forward of micro-batch k at step 2k+s, backward at 2k+2p-1-s).
TRAIN = {
    (1, 1): ["L0 F0 | B0 RT RD OS"],
    (2, 4): [
        "L0 F0 | SA0 | L1 F1 | RG0 SA1 B0 | L0 F0 | RG1 SA0 B1 | L1 F1 | RG0 SA1 B0 |  | RG1 B1 RT RD OS",
        " | RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RT RD OS",
    ],
    (4, 8): [
        "L0 F0 | SA0 | L1 F1 | SA1 | L2 F2 | SA2 | L3 F3 | RG0 SA3 B0 | L0 F0 | RG1 SA0 B1 | L1 F1 | RG2 SA1 B2 | "
        "L2 F2 | RG3 SA2 B3 | L3 F3 | RG0 SA3 B0 |  | RG1 B1 |  | RG2 B2 |  | RG3 B3 RT RD OS",
        " | RA0 F0 | SA0 | RA1 F1 | SA1 | RA2 F2 | RG0 SA2 B0 | SG0 RA0 F0 | RG1 SA0 B1 | SG1 RA1 F1 | RG2 SA1 B2 | "
        "SG2 RA2 F2 | RG0 SA2 B0 | SG0 RA0 F0 | RG1 SA0 B1 | SG1 RA1 F1 | RG2 SA1 B2 | SG2 | RG0 B0 | SG0 | RG1 B1 | "
        "SG1 RT RD OS",
        " |  | RA0 F0 | SA0 | RA1 F1 | RG0 SA1 B0 | SG0 RA0 F0 | RG1 SA0 B1 | SG1 RA1 F1 | RG0 SA1 B0 | SG0 RA0 F0 | "
        "RG1 SA0 B1 | SG1 RA1 F1 | RG0 SA1 B0 | SG0 RA0 F0 | RG1 SA0 B1 | SG1 RA1 F1 | RG0 SA1 B0 | SG0 | RG1 B1 | "
        "SG1 | RT RD OS",
        " |  |  | RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 | B0 | "
        "SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 |  | RT RD OS",
    ],
    (3, 5): [
        "L0 F0 | SA0 | L1 F1 | SA1 | L2 F2 | RG0 SA2 B0 | L0 F0 | RG1 SA0 B1 | L1 F1 | RG2 SA1 B2 |  | RG0 B0 |  | "
        "RG1 B1 RT RD OS",
        " | RA0 F0 | SA0 | RA1 F1 | RG0 SA1 B0 | SG0 RA0 F0 | RG1 SA0 B1 | SG1 RA1 F1 | RG0 SA1 B0 | SG0 RA0 F0 | "
        "RG1 SA0 B1 | SG1 | RG0 B0 | SG0 RT RD OS",
        " |  | RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 | B0 | SG0 RA1 L1 F1 | B1 | SG1 RA0 L0 F0 | B0 | "
        "SG0 | RT RD OS",
    ],
}

INFERENCE = {
    (1, 1): ["L0 F0"],
    (2, 4): ["L0 F0 | L1 SA0 F1 | L0 SA1 F0 | L1 SA0 F1 | SA1", " | L0 RA0 F0 | L1 RA1 F1 | L0 RA0 F0 | L1 RA1 F1"],
    (3, 5): [
        "L0 F0 | L1 SA0 F1 | L0 SA1 F0 | L1 SA0 F1 | L0 SA1 F0 | SA0 | ",
        " | RA0 F0 | RA1 SA0 F1 | RA0 SA1 F0 | RA1 SA0 F1 | RA0 SA1 F0 | SA0",
        " |  | L0 RA0 F0 | L1 RA1 F1 | L0 RA0 F0 | L1 RA1 F1 | L0 RA0 F0",
    ],
}


@pytest.mark.parametrize(("stages", "micro_batches"), sorted(TRAIN))
def test_train_schedule_exact_stream(stages: int, micro_batches: int) -> None:
    for stage, expected in enumerate(TRAIN[(stages, micro_batches)]):
        got = list(TrainSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage))
        assert len(got) == 2 * (micro_batches + stages - 1)
        assert got == parse(expected), f"stage {stage}"


@pytest.mark.parametrize(("stages", "micro_batches"), sorted(INFERENCE))
def test_inference_schedule_exact_stream(stages: int, micro_batches: int) -> None:
    for stage, expected in enumerate(INFERENCE[(stages, micro_batches)]):
        got = list(InferenceSchedule(micro_batches=micro_batches, stages=stages, stage_id=stage))
        assert got == parse(expected), f"stage {stage}"


def test_num_pipe_buffers_is_micro_batches_in_flight_at_least_two() -> None:
    assert [TrainSchedule(8, 4, s).num_pipe_buffers() for s in range(4)] == [4, 3, 2, 2]
    assert [TrainSchedule(2, 4, s).num_pipe_buffers() for s in range(4)] == [2, 2, 2, 2]
    assert [TrainSchedule(3, 6, s).num_pipe_buffers() for s in range(6)] == [3, 3, 3, 3, 2, 2]
    assert InferenceSchedule(5, 3, 1).num_pipe_buffers() == 2
    assert DataParallelSchedule(3, 1, 0).num_pipe_buffers() == 1


def test_data_parallel_schedule() -> None:
    assert list(DataParallelSchedule(2, 1, 0)) == parse("L0 F0 B0 | L0 F0 B0 RD OS")


def test_instruction_repr_and_equality() -> None:
    assert repr(SendGrad(3)) == "SendGrad(buffer_id=3)"
    assert repr(OptimizerStep()) == "OptimizerStep()"
    assert SendGrad(1) == SendGrad(1) and SendGrad(1) != RecvGrad(1) and SendGrad(1) != SendGrad(2)
    assert SendGrad(1).buffer_id == 1 and SendGrad(1).name == "SendGrad"
    schedule = TrainSchedule(4, 2, 1)
    assert (schedule.stage, schedule.num_stages, schedule.num_micro_batches) == (1, 2, 4)
    assert schedule.is_last_stage and not schedule.is_first_stage


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, 2, 0), "micro_batches must be an int >= 1, got 0"),
        ((4, 0, 0), "stages must be an int >= 1, got 0"),
        ((4, 2, 2), r"stage_id must be in \[0, 2\), got 2"),
        ((4, 2, -1), r"stage_id must be in \[0, 2\), got -1"),
    ],
)
def test_bad_arguments_are_named(args: tuple[int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TrainSchedule(*args)
