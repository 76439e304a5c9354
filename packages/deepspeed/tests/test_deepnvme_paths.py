"""DeepNVMe's module paths (`deepspeed.io`, `deepspeed.nvme`, the checkpoint writer's) run DeepSpeed's own calls.

The calls are those of DeepSpeed's `tests/unit/v1/nvme/test_fast_file_writer_fd_close.py`, on host memory:
an `aio_handle` from the op builder, a `FastFileWriterConfig`, `torch.save` into the writer.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import torch


def test_fast_file_writer_through_deepspeeds_names(tmp_path: Path) -> None:
    from deepspeed.io import FastFileWriter, FastFileWriterConfig
    from deepspeed.io.double_io_buffer import Double_IO_Buffer
    from deepspeed.ops.op_builder import AsyncIOBuilder

    aio = (
        AsyncIOBuilder()
        .load(verbose=False)
        .aio_handle(
            block_size=1 << 20, queue_depth=8, single_submit=False, overlap_events=False, intra_op_parallelism=1
        )
    )
    pinned = torch.zeros(8 << 20, dtype=torch.uint8)
    for double in (True, False):
        cfg = FastFileWriterConfig(
            dnvme_handle=aio, pinned_tensor=pinned, double_buffer=double, num_parallel_writers=1, writer_rank=0
        )
        target = tmp_path / f"ckpt_{double}.pt"
        writer = FastFileWriter(file_path=str(target), config=cfg)
        payload = {"w": torch.randn(300_000), "step": 3}
        torch.save(obj=payload, f=writer)
        writer.close()
        expected = io.BytesIO()
        torch.save(payload, expected)
        assert target.read_bytes() == expected.getvalue()
        assert isinstance(writer._io_buffer, Double_IO_Buffer) is double
        os.unlink(target)
    targets = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            targets.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # the descriptor listdir itself used
            continue
    assert not [t for t in targets if t.startswith(str(tmp_path))]  # no descriptor left on the unlinked files


def test_nvme_and_checkpointing_paths() -> None:
    import deepspeed.nvme
    from deepspeed.io.constants import AIO_SPEED_KEY, WRITE_BYTES_KEY
    from deepspeed.nvme.parse_nvme_stats import READ_SPEED, get_sorted_results, main
    from deepspeed.nvme.perf_sweep_utils import BENCH_LOG_DIR, READ_LOG_DIR, WRITE_LOG_DIR
    from deepspeed.runtime.checkpoint_engine import FastCheckpointEngine
    from deepspeed.runtime.model_checkpointing import CHECKPOINT_WRITER, CheckpointWriterType

    assert callable(deepspeed.nvme.sweep_main) and callable(deepspeed.nvme.generate_main)
    assert callable(deepspeed.nvme.ds_io_main) and callable(deepspeed.nvme.parse_sweep_arguments)
    assert (BENCH_LOG_DIR, READ_LOG_DIR, WRITE_LOG_DIR) == (
        "_aio_bench_logs",
        "_aio_bench_read_logs",
        "_aio_bench_write_logs",
    )
    assert (AIO_SPEED_KEY, WRITE_BYTES_KEY, READ_SPEED) == ("aio_GB/s", "bytes", "read_speed")
    assert callable(get_sorted_results) and callable(main)
    assert CHECKPOINT_WRITER == "writer" and CheckpointWriterType.FAST == "FAST"
    assert FastCheckpointEngine.name == "FastCheckpointEngine"


def test_multi_task_ds_io_through_deepspeeds_module_paths(tmp_path: Path) -> None:
    """DeepSpeed's `ds_io` internals by their paths: its flags, its task runner and the handle engine."""
    from deepspeed.nvme.ds_aio_args import get_validated_args
    from deepspeed.nvme.ds_aio_handle import AIOHandle_Engine
    from deepspeed.nvme.ds_aio_job import Job, run_job
    from deepspeed.nvme.io_engine import io_engine_multiprocessing, prepare_operation
    from deepspeed.nvme.test_ds_aio_utils import create_filename, refine_integer_value

    args = get_validated_args(["--folder", str(tmp_path), "--io_size", "1M", "--multi_process", "2", "--loops", "1"])
    assert args.mapping_list == [(0, str(tmp_path)), (1, str(tmp_path))] and args.total_loops == 2
    engine = prepare_operation(args, 0, False)
    assert isinstance(engine, AIOHandle_Engine)
    engine.fini()
    results = io_engine_multiprocessing(args, False)
    assert len(results) == 2 and all(r is not None and r[2] == refine_integer_value("1M") for r in results)
    assert os.path.getsize(create_filename(str(tmp_path), False, 1 << 20, "1_0")) == 1 << 20
    run_job(Job(["true"]))
