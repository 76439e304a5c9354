"""Replay a traced pipeline batch with free communication: how much of the bubble the stage times alone make.

`benchmarks/pipe.py` records, on every stage, each instruction of a timed batch with how long it ran.
`replay()` runs the same instruction streams again on paper: forward, backward and the other compute
instructions take the time they took, sends and receives take none, and a receive waits only for its
matching send (the k-th activation sent by stage s is the k-th received by stage s + 1; gradients the
other way). The result is the batch time with a free, zero-latency transport, given the stage times the
batch really had. With equal stage times it is the 1F1B theory; stage times that vary from one
micro-batch to the next (a `time.sleep` that overshoots by a varying amount, here) make it longer,
because a pipeline waits for the slowest path where sequential execution pays only the mean.

So the measured batch time splits into: the theory, what the stage-time jitter adds (replay - theory at
the mean stage time), and what the transport and the executor add (measured - replay).
"""

from __future__ import annotations

import time
from typing import Any

COMPUTE_FREE = frozenset({"SendActivation", "SendGrad", "RecvActivation", "RecvGrad"})

# One stage's trace: (instruction name, seconds) in the order it ran.
Trace = list[tuple[str, float]]


def record(executor: Any) -> Trace:
    """Wrap `executor`'s instruction handlers so every instruction is appended to the returned list."""
    trace: Trace = []
    for kind, handler in list(executor._handlers.items()):

        def timed(instruction: Any, handler: Any = handler) -> None:
            began = time.perf_counter()
            handler(instruction)
            trace.append((instruction.name, time.perf_counter() - began))

        executor._handlers[kind] = timed
    return trace


def replay(traces: list[Trace]) -> float:
    """The batch time of `traces` (one per stage, in stage order) with free sends and receives, seconds."""
    stages = len(traces)
    clock = [0.0] * stages
    position = [0] * stages
    sent: dict[tuple[str, int, int], float] = {}  # (kind, sending stage, index) -> when it was sent
    counts = [{"SendActivation": 0, "SendGrad": 0, "RecvActivation": 0, "RecvGrad": 0} for _ in range(stages)]
    while any(position[s] < len(traces[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            while position[s] < len(traces[s]):
                name, seconds = traces[s][position[s]]
                if name in ("RecvActivation", "RecvGrad"):
                    source = s - 1 if name == "RecvActivation" else s + 1
                    key = ("A" if name == "RecvActivation" else "G", source, counts[s][name])
                    if key not in sent:
                        break  # its send has not happened yet on paper: run the other stages first
                    clock[s] = max(clock[s], sent[key])
                elif name in ("SendActivation", "SendGrad"):
                    sent[("A" if name == "SendActivation" else "G", s, counts[s][name])] = clock[s]
                else:
                    clock[s] += seconds
                if name in counts[s]:
                    counts[s][name] += 1
                position[s] += 1
                moved = True
        if not moved:
            raise RuntimeError("the traced streams' sends and receives do not pair up")
    return max(clock)


def mean_stage_seconds(traces: list[Trace]) -> float:
    """Mean forward + backward time of one micro-batch on one stage, over every stage of the batch."""
    forward = [t for trace in traces for name, t in trace if name == "ForwardPass"]
    backward = [t for trace in traces for name, t in trace if name == "BackwardPass"]
    return sum(forward) / len(forward) + sum(backward) / len(backward)
