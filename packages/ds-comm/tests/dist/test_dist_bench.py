"""`ds_bench` on 2 gloo ranks: every op at two sizes, the bus-bandwidth factors, the printed table and the CLI."""

from __future__ import annotations

import contextlib
import io
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ds_comm import bench
from ds_comm.testing import run_ranks

# Bus bandwidth over algorithmic bandwidth on 2 ranks, as nccl-tests defines it.
FACTOR_2_RANKS = {"all_reduce": 1.0, "all_gather": 0.5, "all_to_all": 0.5, "broadcast": 1.0, "pt2pt": 1.0}


def _rows(rank: int, world: int) -> list[dict]:
    rows = bench.run_benchmark(bench.OPS, [1024, 8192], trials=3, warmups=1)
    return [vars(r) for r in rows]


def test_every_op_and_size_with_its_bus_factor() -> None:
    per_rank = run_ranks(2, _rows, timeout_s=120)
    rows = per_rank[0]
    assert [(r["op"], r["size_bytes"]) for r in rows] == [(op, s) for op in bench.OPS for s in (1024, 8192)]
    for r in rows:
        assert r["numel"] == r["size_bytes"] // 4 and r["trials"] == 3 and r["duration_s"] > 0
        assert r["algbw_bytes_s"] == pytest.approx(r["size_bytes"] / r["duration_s"])
        assert r["busbw_bytes_s"] == pytest.approx(r["algbw_bytes_s"] * FACTOR_2_RANKS[r["op"]])
    # the duration is the slowest rank's, so every rank reports the same table
    assert [r["duration_s"] for r in per_rank[1]] == [r["duration_s"] for r in rows]


def _cli(rank: int, world: int) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = bench.main(
            [
                "--all-reduce",
                "--pt2pt",
                "--scan",
                "--maxsize",
                "11",
                "--trials",
                "2",
                "--warmups",
                "0",
                "--bw-unit",
                "GBps",
            ]
        )
    return f"{status}\n{out.getvalue()}"


def test_cli_prints_one_table_per_op_on_rank_0() -> None:
    first, second = run_ranks(2, _cli, timeout_s=120)
    assert second == "0\n"  # other ranks print nothing
    lines = first.splitlines()
    assert lines[0] == "0"
    assert lines[1] == "---- Performance of all_reduce on 2 ranks ----"
    assert lines[2].split() == ["Size", "(Bytes)", "Description", "Duration", "Throughput", "(GBps)", "BusBW", "(GBps)"]
    assert lines[3].startswith("1.00 KB") and "2x256" in lines[3]
    assert lines[4].startswith("2.00 KB") and "2x512" in lines[4]
    assert lines[5] == "---- Performance of pt2pt on 2 ranks ----"
    assert len(lines) == 9


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unlaunched_run_is_one_rank_and_says_so() -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    done = subprocess.run(
        [sys.executable, "-m", "ds_comm.bench", "--broadcast", "--maxsize", "10", "--trials", "2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith("ds_bench: running on 1 rank")
    assert "---- Performance of broadcast on 1 ranks ----" in done.stdout


def test_pt2pt_needs_two_ranks_and_the_script_is_declared() -> None:
    with pytest.raises(ValueError, match="at least 2 ranks"):
        bench._op_call("pt2pt", 4, bench._DTYPES["float"], world=1, rank=0)
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    assert tomllib.loads(pyproject.read_text())["project"]["scripts"]["ds_bench"] == "ds_comm.bench:main"
