"""`ds_io` and `ds_nvme_tune` on a small file in a temp dir, and the ds-ops console-script entry points."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch

from ds_ops import nvme_bench, nvme_tune

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
SMALL_SWEEP = {
    "block_size": ["256K", "1M"],
    "queue_depth": [4],
    "sequential_requests": [True, False],
    "single_submit": [False],
    "io_parallel": [1],
}


def test_entry_points_are_declared() -> None:
    scripts = tomllib.loads(PYPROJECT.read_text())["project"]["scripts"]
    assert scripts["dsr"] == scripts["ds_report"] == "ds_ops.report:main"  # DeepSpeed's dsr links to ds_report
    assert scripts["ds_io"] == "ds_ops.nvme_bench:ds_io_main"
    assert scripts["ds_nvme_tune"] == "ds_ops.nvme_tune:ds_nvme_tune_main"


@pytest.mark.parametrize(("text", "size"), [("400M", 400 << 20), ("1k", 1024), ("4096", 4096), ("2GB", 2 << 30)])
def test_sizes_use_deepspeeds_suffixes(text: str, size: int) -> None:
    assert nvme_bench.parse_size(text) == size


@pytest.mark.parametrize("text", ["", "1T", "-4M", "0"])
def test_bad_sizes_are_named(text: str) -> None:
    with pytest.raises(ValueError, match=repr(text).replace("(", r"\(")):
        nvme_bench.parse_size(text)


@pytest.mark.parametrize("engine", ["aio_handle", "aio_basic"])
@pytest.mark.parametrize("read", [False, True])
def test_ds_io_moves_and_validates_the_bytes(
    tmp_path: Path, read: bool, engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [
        "--engine",
        engine,
        "--folder",
        str(tmp_path),
        "--io_size",
        "2M",
        "--block_size",
        "256K",
        "--queue_depth",
        "4",
        "--loops",
        "2",
        "--validate",
        *(["--read"] if read else []),
    ]
    assert nvme_bench.ds_io_main(argv) == 0
    *speed_lines, line = capsys.readouterr().out.strip().splitlines()
    what = "Read" if read else "Write"
    assert [x.split(" = ")[0] for x in speed_lines] == [
        f"Task {what} Latency",
        f"Task {what} Speed",
        f"E2E {what} Latency",
        f"E2E {what} Speed",
    ]
    assert float(speed_lines[-1].split()[-2]) > 0 and speed_lines[-1].endswith("GB/sec")
    assert line.startswith(f"{'read' if read else 'write'} 2097152 bytes x 2 loops: best ")
    assert line.endswith("validated") and "block_size=262144 queue_depth=4" in line
    assert list(tmp_path.iterdir()) == []  # the scratch file is removed


def test_run_io_times_each_loop(tmp_path: Path) -> None:
    result = nvme_bench.run_io(tmp_path, 1 << 20, read=True, loops=3, warmup_loops=0, block_size=1 << 18)
    assert len(result.seconds) == 3 and all(s > 0 for s in result.seconds)
    assert result.best_gbps == pytest.approx((1 << 20) / min(result.seconds) / 1e9)
    assert result.best_gbps >= result.mean_gbps


def test_validation_names_the_first_differing_byte() -> None:
    expected = torch.arange(8, dtype=torch.uint8)
    got = expected.clone()
    got[5] = 0
    with pytest.raises(ValueError, match="byte 5 is 0, expected 5"):
        nvme_bench._check_same(got, expected, "f.bin")


def test_ds_io_refuses_a_missing_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert nvme_bench.ds_io_main(["--folder", str(tmp_path / "nope"), "--io_size", "1M"]) == 2
    assert "is not a directory" in capsys.readouterr().err


def test_nvme_tune_proposes_the_fastest_measured_setting(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from ds_ops.aio import AioConfig

    sweep_file, log_dir = tmp_path / "sweep.json", tmp_path / "logs"
    sweep_file.write_text(json.dumps(SMALL_SWEEP))
    (tmp_path / "io").mkdir()
    argv = [
        "--nvme_dir",
        str(tmp_path / "io"),
        "--io_size",
        "1M",
        "--sweep_config",
        str(sweep_file),
        "--log_dir",
        str(log_dir),
    ]
    assert nvme_tune.ds_nvme_tune_main(argv) == 0
    out = capsys.readouterr().out
    records = [json.loads(line) for line in (log_dir / "sweep.jsonl").read_text().splitlines()]
    assert len(records) == 4  # 2 block sizes x 2 request modes
    best = max(records, key=lambda r: r["read_gbps"] + r["write_gbps"])
    section = json.loads(out[out.index("{") :])
    assert section["aio"] == {
        "block_size": nvme_bench.parse_size(best["block_size"]),
        "queue_depth": 4,
        "intra_op_parallelism": 1,
        "single_submit": False,
        "overlap_events": not best["sequential_requests"],
    }
    AioConfig(**section["aio"])  # the proposal is a valid ds_config aio section
    assert f"read = {best['read_gbps']:5.2f}, write = {best['write_gbps']:5.2f}" in out


def test_nvme_tune_rejects_unknown_sweep_keys(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['blocksize'\]"):
        nvme_tune.sweep(str(tmp_path), 4096, {"blocksize": ["1M"]})
    with pytest.raises(ValueError, match="nothing to measure"):
        nvme_tune.sweep(str(tmp_path), 4096, SMALL_SWEEP, read=False, write=False)


@pytest.mark.parametrize("engine", ["torch_io", "torch_fastio"])
def test_ds_io_torch_engines_write_what_torch_save_writes(
    tmp_path: Path, engine: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--folder", str(tmp_path), "--io_size", "1M", "--loops", "2", "--warmup_loops", "0", "--validate"]
    assert nvme_bench.ds_io_main([*argv, "--engine", engine, "--fast_io_size", "256K"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("write 1048576 bytes x 2 loops") and f"engine={engine}" in line and "validated" in line
    assert not list(tmp_path.iterdir())  # the file is removed afterwards


def test_torch_engines_write_torch_saves_bytes(tmp_path: Path) -> None:
    import types

    from ds_ops.nvme_torch_io import FILE, TorchFastIOEngine, TorchIOEngine

    args = types.SimpleNamespace(
        mapping_list=[(0, str(tmp_path / "a")), (0, str(tmp_path / "b"))],
        io_size=300_000,
        gpu=False,
        block_size=1 << 16,
        queue_depth=4,
        single_submit=False,
        sequential_requests=False,
        io_parallel=1,
        fast_io_size=1 << 16,
    )
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    plain, fast = TorchIOEngine(args, 0, False), TorchFastIOEngine(args, 1, False)
    fast.ctxt["buffer"].copy_(plain.ctxt["buffer"])
    assert plain.write() > 0 and fast.write() > 0
    assert plain.ctxt[FILE].endswith("_aio_write_300000.pt.0") and fast.ctxt[FILE].endswith(".pt.1")
    with open(tmp_path / "ref.pt", "wb") as f:  # a file object, as the FastFileWriter is: same zip record names
        torch.save(fast.ctxt["buffer"], f)
    assert Path(fast.ctxt[FILE]).read_bytes() == (tmp_path / "ref.pt").read_bytes()
    assert torch.equal(torch.load(plain.ctxt[FILE], weights_only=True), plain.ctxt["buffer"])
    plain.fini()
    fast.fini()
    with pytest.raises(ValueError, match="torch_fastio times writes only"):
        TorchFastIOEngine(args, 0, True)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine", "torch_io", "--read"], "--engine torch_io times writes only"),
        (["--engine", "aio_bogus"], "--engine 'aio_bogus' is not one of aio_handle, aio_basic, torch_io, torch_fastio"),
    ],
)
def test_ds_io_refuses_unsupported_engines(
    tmp_path: Path, extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert nvme_bench.ds_io_main(["--folder", str(tmp_path), "--io_size", "1M", *extra]) == 2
    assert message in capsys.readouterr().err


def test_functional_aio_calls_hang_on_the_op_and_move_the_bytes(tmp_path: Path) -> None:
    """DeepSpeed's `AsyncIOBuilder().load().aio_write/aio_read(buffer, file, block, depth, single, overlap, validate)`
    on ds's op."""
    from ds_ops.aio import AioError
    from ds_ops.op_builder import AsyncIOBuilder

    op = AsyncIOBuilder().load(verbose=False)
    path = tmp_path / "basic.bin"
    data = torch.randint(0, 256, (3 << 18,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    assert op.aio_write(data, str(path), 1 << 18, 4, False, True, True) == 0
    assert path.read_bytes() == bytes(data.numpy())
    back = torch.zeros_like(data)
    assert op.aio_read(back, str(path), 1 << 18, 4, True, False, True) == 0
    assert torch.equal(back, data)
    with pytest.raises(AioError, match="missing.bin"):
        op.aio_read(back, str(tmp_path / "missing.bin"), 1 << 18, 4, False, True, False)


def test_aio_basic_engine_writes_and_reads_the_task_file(tmp_path: Path) -> None:
    """`deepspeed.nvme.ds_aio_basic.AIOBasic_Engine` with DeepSpeed's (args, tid, read_op) and ctxt keys."""
    import types

    from ds_ops.nvme.ds_aio_basic import AIOBasic_Engine
    from ds_ops.nvme.ds_aio_constants import BUFFER, ELAPSED_SEC, FILE, NUM_BYTES

    args = types.SimpleNamespace(
        mapping_list=[(0, str(tmp_path))], io_size=1 << 20, read=False, block_size=1 << 18, queue_depth=4,
        single_submit=False, sequential_requests=False, validate=True,
    )  # fmt: skip
    writer = AIOBasic_Engine(args, 0, False)
    writer.ctxt[BUFFER].copy_(torch.arange(1 << 20, dtype=torch.int64).to(torch.uint8))
    assert writer.write(args, 0, 0) > 0 and writer.write(args, 0, 1) > 0
    written = Path(writer.ctxt[FILE])
    assert written.name == f"_aio_write_{1 << 20}.pt.0" and written.read_bytes() == bytes(writer.ctxt[BUFFER].numpy())
    assert writer.ctxt[NUM_BYTES] == 1 << 20 and writer.ctxt[ELAPSED_SEC] > 0
    writer.fini()
    args.read = True
    reader = AIOBasic_Engine(args, 0, True)  # creates the read file of io_size random bytes
    assert reader.read(args, 0, 0) > 0
    assert bytes(reader.ctxt[BUFFER].numpy()) == Path(reader.ctxt[FILE]).read_bytes()
    reader.fini()
