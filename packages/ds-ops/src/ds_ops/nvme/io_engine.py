"""`deepspeed.nvme.io_engine`: `ds_io`'s tasks, one process each, timed loop by loop behind a shared barrier.

`io_engine_multiprocessing(args, read_op)` starts one process per entry of `args.mapping_list` (spawned, as
DeepSpeed's `ds_io` does), each builds its engine (`prepare_operation`: `--engine` aio_handle, aio_basic,
torch_io or torch_fastio), then all run `total_loops` reads or writes in step: every loop ends at the
barrier, so a loop's wall time is the slowest task's. Each task returns its end-to-end seconds (the loops'
wall time), its I/O seconds (what its engine's calls took) and its bytes, both without the warm-up loops
unless `--include_warmup_time`; `report_results` prints the run's latency and speed from them.

A task that fails breaks the barrier, so the others stop at their next wait instead of waiting forever
(DeepSpeed's hang); its error is printed naming the task, and the run's result is None for it.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any

from ds_ops.nvme.ds_aio_basic import AIOBasic_Engine
from ds_ops.nvme.ds_aio_constants import AIO_BASIC, NUM_BYTES, TORCH_FAST_IO, TORCH_IO
from ds_ops.nvme.ds_aio_handle import AIOHandle_Engine
from ds_ops.nvme.test_ds_aio_utils import report_results, task_barrier, task_log
from ds_ops.nvme.torch_fastio_engine import Torch_FastIO_Engine
from ds_ops.nvme.torch_io import TorchIO_Engine

__all__ = [
    "get_schedule",
    "io_engine_multiprocessing",
    "io_engine_tasklet",
    "post_operation",
    "prepare_operation",
    "prepare_read",
    "prepare_write",
    "read_operation",
    "write_operation",
]

aio_barrier: Any = None
"""The run's barrier, set in each task process by the pool's initializer."""


def prepare_operation(args: Any, tid: int, read_op: bool) -> Any:
    """Task `tid`'s engine for `args.engine`."""
    engines = {TORCH_IO: TorchIO_Engine, AIO_BASIC: AIOBasic_Engine, TORCH_FAST_IO: Torch_FastIO_Engine}
    return engines.get(args.engine, AIOHandle_Engine)(args, tid, read_op)


def prepare_read(pool_params: tuple[Any, int]) -> Any:
    args, tid = pool_params
    return prepare_operation(args, tid, True)


def prepare_write(pool_params: tuple[Any, int]) -> Any:
    args, tid = pool_params
    return prepare_operation(args, tid, False)


def post_operation(pool_params: tuple[Any, int, Any]) -> None:
    _, _, engine = pool_params
    engine.fini()


def read_operation(pool_params: tuple[Any, int, int, Any]) -> float:
    args, tid, loop_id, engine = pool_params
    return float(engine.read(args, tid, loop_id))


def write_operation(pool_params: tuple[Any, int, int, Any]) -> float:
    args, tid, loop_id, engine = pool_params
    return float(engine.write(args, tid, loop_id))


def get_schedule(args: Any, read_op: bool) -> dict[str, Any]:
    """The task's three steps: build the engine ("pre"), one loop ("main"), release it ("post")."""
    if read_op:
        return {"pre": prepare_read, "post": post_operation, "main": read_operation}
    return {"pre": prepare_write, "post": post_operation, "main": write_operation}


def io_engine_tasklet(pool_params: tuple[Any, int, bool]) -> tuple[float, float, int] | None:
    """One task's run: (end-to-end seconds, I/O seconds, bytes) of its counted loops; None if it failed."""
    args, tid, read_op = pool_params
    parties = len(args.mapping_dict)
    try:
        schedule = get_schedule(args, read_op)
        task_barrier(aio_barrier, parties)
        task_log(tid, "running pre-task")
        engine = schedule["pre"]((args, tid))
        task_barrier(aio_barrier, parties)
        wall, io = [], []
        for i in range(args.total_loops):
            task_log(tid, f"running main task {i}")
            start = time.perf_counter()
            io.append(schedule["main"]((args, tid, i, engine)))
            task_barrier(aio_barrier, parties)
            wall.append(time.perf_counter() - start)
        task_log(tid, "running post-task")
        schedule["post"]((args, tid, engine))
        task_barrier(aio_barrier, parties)
    except threading.BrokenBarrierError:
        task_log(tid, "stopped: another task failed", force=True)
        return None
    except Exception as err:  # noqa: BLE001 - reported by task, the run goes on to its summary
        task_log(tid, f"failed: {type(err).__name__}: {err}", force=True)
        aio_barrier.abort()
        return None
    first = 0 if args.include_warmup_time else args.warmup_loops
    task_log(tid, f"task_latency_sec = {io}")
    return sum(wall[first:]), sum(io[first:]), engine.ctxt[NUM_BYTES] * (args.total_loops - first)


def _init_tasklet(barrier: Any) -> None:
    global aio_barrier  # noqa: PLW0603 - one barrier per task process, as DeepSpeed's
    aio_barrier = barrier


def io_engine_multiprocessing(args: Any, read_op: bool) -> list[tuple[float, float, int] | None]:
    """Run every task of `args.mapping_list` in its own process and print the summary; the tasks' results."""
    parties = len(args.mapping_dict)
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(parties)
    params = [(args, tid, read_op) for tid in range(parties)]
    with context.Pool(processes=parties, initializer=_init_tasklet, initargs=(barrier,)) as pool:
        results = pool.map(io_engine_tasklet, params, chunksize=1)
    report_results(args, read_op, results)
    return results
