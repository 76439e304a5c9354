"""`deepspeed.runtime.pipe.engine`: the pipeline engine under DeepSpeed's module path.

Scripts import `PipelineEngine` from here (`isinstance(engine, PipelineEngine)`), and the module's
constants: the ids DeepSpeed's engine gives its targets and log stage, the names of its pipeline timers,
and the size of its tensor-meta message. ds's engine is `ds_engine._pipeline.engine.PipelineEngine`; the
constants are DeepSpeed 0.19.8's values, for code that reads them.
"""

from __future__ import annotations

from ds_engine._engine.engine import DeepSpeedEngine
from ds_engine._pipeline.build import PipelineError
from ds_engine._pipeline.engine import PipelineEngine

__all__ = [
    "BATCH_INPUT_TIMER",
    "DATA_PARALLEL_ID",
    "LOG_STAGE",
    "PIPE_RECV_GRAD_TIMER",
    "PIPE_RECV_INPUT_TIMER",
    "PIPE_SEND_GRAD_TIMER",
    "PIPE_SEND_OUTPUT_TIMER",
    "TARGET_ID",
    "TENSOR_META_SIZE",
    "TRAIN_BATCH_TIMER",
    "DeepSpeedEngine",
    "PipelineEngine",
    "PipelineError",
    "is_even",
]

TARGET_ID = -2
LOG_STAGE = -2
DATA_PARALLEL_ID = -2

BATCH_INPUT_TIMER = "batch_input"
TRAIN_BATCH_TIMER = "train_batch"
PIPE_SEND_OUTPUT_TIMER = "pipe_send_output"
PIPE_SEND_GRAD_TIMER = "pipe_send_grad"
PIPE_RECV_INPUT_TIMER = "pipe_recv_input"
PIPE_RECV_GRAD_TIMER = "pipe_recv_grad"

TENSOR_META_SIZE = 256


def is_even(number: int) -> bool:
    """Whether `number` is even (DeepSpeed's helper of this module)."""
    return number % 2 == 0
