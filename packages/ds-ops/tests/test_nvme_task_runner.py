"""DeepSpeed's multi-task `ds_io` (`deepspeed.nvme.ds_aio_args`, `io_engine`, `ds_aio_handle`, `ds_aio_job`).

Real runs on small files in a temp dir: tasks in their own (spawned) processes write and read what they
should, the summary is printed, DeepSpeed's flags are read and each bad one is named, and a task that fails
ends the run instead of leaving the others at the barrier.
"""

from __future__ import annotations

import os
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from ds_ops import nvme_bench
from ds_ops.nvme.ds_aio_args import get_validated_args
from ds_ops.nvme.ds_aio_constants import BUFFER, ELAPSED_SEC, FILE
from ds_ops.nvme.ds_aio_handle import AIOHandle_Engine
from ds_ops.nvme.ds_aio_job import Job, run_job
from ds_ops.nvme.test_ds_aio_utils import get_block_size_and_count, refine_integer_value

pytestmark = pytest.mark.timeout(180)
MIB = 2**20


def test_two_tasks_write_their_files_and_the_run_is_summarised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--folder", str(tmp_path), "--io_size", "2M", "--multi_process", "2", "--loops", "2"]
    assert nvme_bench.ds_io_main(argv) == 0
    out = capsys.readouterr().out
    assert "Task Write Speed" in out and "E2E Write Latency" in out
    assert sorted(os.listdir(tmp_path)) == [f"_aio_write_{2 * MIB}.pt.0_0", f"_aio_write_{2 * MIB}.pt.1_0"]
    assert all(os.path.getsize(tmp_path / name) == 2 * MIB for name in os.listdir(tmp_path))


def test_folder_to_device_mapping_reads_a_new_file_each_loop_with_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir()
    second.mkdir()
    argv = ["--folder_to_device_mapping", f"{first}:0", f"{second}:1", "--io_size", "1M", "--read", "--validate"]
    assert nvme_bench.ds_io_main([*argv, "--different_file_each_iteration", "--loops", "2"]) == 0
    assert "Task Read Speed" in capsys.readouterr().out
    for tid, folder in enumerate((first, second)):  # warm-up + 2 loops: three files made to read, per task
        assert sorted(os.listdir(folder)) == [f"_aio_read_{MIB}.pt.{tid}_{i}" for i in range(3)]


def _engine_args(folder: Path, read: bool) -> Namespace:
    args = get_validated_args(["--folder", str(folder), "--io_size", "1M", "--block_size", "128K", "--loops", "2"])
    args.read = read
    return args


def test_the_handle_engine_moves_the_bytes_each_loop(tmp_path: Path) -> None:
    writer = AIOHandle_Engine(_engine_args(tmp_path, read=False), 0, False)
    written = writer.ctxt[BUFFER].clone()
    writer_args = _engine_args(tmp_path, read=False)
    for loop in range(writer_args.total_loops):  # warm-up + 2
        writer.write(writer_args, 0, loop)
    assert len(writer.ctxt[ELAPSED_SEC]) == 3
    path = writer.ctxt[FILE][0]
    assert Path(path).read_bytes() == bytes(written.numpy())
    writer.fini()
    reader_args = _engine_args(tmp_path, read=True)
    reader = AIOHandle_Engine(reader_args, 0, True)
    made = Path(reader.ctxt[FILE][0]).read_bytes()  # the read file is made first, of random bytes
    assert len(made) == MIB
    reader.read(reader_args, 0, 0)
    assert bytes(reader.ctxt[BUFFER].numpy()) == made
    reader.fini()


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--folder", "{tmp}/missing"], "--folder"),
        (["--folder", "{tmp}", "--folder_to_device_mapping", "{tmp}:0"], "cannot be given together"),
        (["--folder_to_device_mapping", "{tmp}"], "--folder_to_device_mapping"),
        (["--folder", "{tmp}", "--engine", "torch_io", "--read"], "--read: --engine torch_io"),
        (["--folder", "{tmp}", "--engine", "nope"], "--engine nope"),
        (["--folder", "{tmp}", "--use_gds"], "--use_gds needs --gpu"),
        (["--folder", "{tmp}", "--block_size", "1X"], "--block_size '1X'"),
        (["--folder", "{tmp}", "--multi_process", "0"], "--multi_process 0"),
    ],
)
def test_bad_flags_are_named_and_nothing_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], named: str
) -> None:
    words = [w.replace("{tmp}", str(tmp_path)) for w in argv]
    with pytest.raises(SystemExit) as stop:
        nvme_bench.ds_io_main([*words, "--io_size", "1M", "--include_warmup_time"])  # a task flag: DeepSpeed's runner
    assert stop.value.code == 2
    assert named in capsys.readouterr().out
    assert not [p for p in tmp_path.rglob("_aio_*")]


def test_a_failing_task_ends_the_run_instead_of_hanging(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good"
    good.mkdir()
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")  # exists, so the flags pass; the task cannot create its file under it
    argv = ["--folder_to_device_mapping", f"{not_a_folder}:0", f"{good}:1", "--io_size", "1M", "--loops", "2"]
    assert nvme_bench.ds_io_main(argv) == 1
    out = capfd.readouterr().out  # the tasks' lines come from their own processes
    assert "tid 0: failed" in out and "Failure in one of 2 Write processes" in out


def test_gpu_runs_are_refused_without_a_device(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    with pytest.raises(SystemExit):
        nvme_bench.ds_io_main(["--folder", str(tmp_path), "--io_size", "1M", "--gpu"])
    assert "--gpu: no CUDA device here" in capsys.readouterr().out


def test_size_strings_and_dd_block_counts() -> None:
    assert refine_integer_value("64M") == 64 * MIB and refine_integer_value("3k") == 3072
    assert refine_integer_value("4096") == 4096
    assert get_block_size_and_count(8 * MIB) == ("1M", 8) and get_block_size_and_count(4096) == ("1K", 4)
    with pytest.raises(ValueError, match="multiple of 1K"):
        get_block_size_and_count(1000)


def test_a_job_runs_its_command_and_a_failure_names_it(tmp_path: Path) -> None:
    out = tmp_path / "out.txt"
    run_job(Job(["echo", "hello"], output_file=str(out)))
    assert out.read_text() == "hello\n"
    with pytest.raises(RuntimeError, match="failed with exit status 3: sh -c exit 3; its output is in"):
        run_job(Job("sh -c 'exit 3'", output_file=str(out)))
