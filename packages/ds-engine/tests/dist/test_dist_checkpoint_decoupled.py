"""`checkpoint.writer.decoupled: true` on 2 gloo ranks (ZeRO 1, so each rank writes a file of its own).

* A decoupled save is, after its commit, byte for byte the synchronous save of the same state, although the
  writer is held (an injected gate) until after the next optimizer step: the step does not wait for the
  write, `latest` does not move before the commit, and the step's update is not in the file.
* An injected write failure on one rank is raised at the commit on both ranks (naming the file on that
  rank), leaves `latest` on the previous tag, which still loads; the next save then works.
* `engine.destroy()` finishes and commits a save still in flight; a process that ends with writes queued
  finishes them at exit (the harness has removed the process group by then, so `latest` stays).
"""

from __future__ import annotations

import importlib.util
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_comm.testing import run_ranks

needs_zero = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero (ZeRO stage 1)")

CONFIG = base_config(
    zero_optimization={"stage": 1},
    checkpoint={"writer": {"io_buffer_size": 8192, "decoupled": True}},
)


def _train(engine: Any, rank: int, steps: int, seed: int = 1) -> None:
    for x, y in batches(steps, 4, seed=seed + rank):
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def _gate_writer(engine: Any, gate: threading.Event, waited_out: list[bool]) -> None:
    """The background writer first waits for `gate` (60 s at most, recorded: a step that waited for the write
    would only return after that)."""
    writer = engine._checkpointer.decoupled
    real = writer._save

    def slow(obj: Any, path: Any, **kw: Any) -> None:
        waited_out.append(not gate.wait(60))
        real(obj, path, **kw)

    writer._save = slow


def _byte_equal_after_commit(rank: int, world: int, root: str) -> dict[str, Any]:
    engine = make_engine(tiny_net(0), CONFIG)
    _train(engine, rank, 2)
    decoupled = engine._checkpointer.decoupled
    engine._checkpointer.decoupled = None  # the synchronous path of the same engine, for the reference files
    engine.save_checkpoint(str(Path(root) / "sync"), tag="t")
    engine._checkpointer.decoupled = decoupled
    gate, waited_out = threading.Event(), []
    _gate_writer(engine, gate, waited_out)
    before = flat_params(engine.module).clone()
    engine.save_checkpoint(str(Path(root) / "dec"), tag="t")
    _train(engine, rank, 1, seed=7)  # the step after the save: returns while the writer is held
    stepped = not torch.equal(before, flat_params(engine.module))
    mine = Path(root) / "dec" / "t" / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
    seen_before_commit = {"latest": (Path(root) / "dec" / "latest").exists(), "file": mine.exists()}
    gate.set()
    committed = engine.commit_checkpoint()
    return {
        "stepped": stepped,
        "seen_before_commit": seen_before_commit,
        "committed": committed,
        "waited_out": waited_out,
        "engine_name": engine.checkpoint_engine.name,
    }


@needs_zero
def test_decoupled_save_equals_sync_save_and_training_goes_on(tmp_path: Path) -> None:
    results = run_ranks(2, _byte_equal_after_commit, root=str(tmp_path), timeout_s=240)
    for r in results:
        assert r["stepped"] and r["committed"] and r["engine_name"] == "DecoupledCheckpointEngine"
        assert r["seen_before_commit"] == {"latest": False, "file": False}
        assert r["waited_out"] and not any(r["waited_out"])  # the writer was released by the test, after the step
    sync, dec = tmp_path / "sync" / "t", tmp_path / "dec" / "t"
    names = sorted(p.name for p in sync.iterdir() if p.suffix == ".pt")
    assert names == sorted(p.name for p in dec.iterdir() if p.suffix == ".pt") and len(names) == 3
    for name in names:
        assert (sync / name).read_bytes() == (dec / name).read_bytes(), name
    assert (tmp_path / "dec" / "latest").read_text() == "t"


def _failure_keeps_last_good(rank: int, world: int, root: str) -> dict[str, Any]:
    engine = make_engine(tiny_net(0), CONFIG)
    _train(engine, rank, 2)
    engine.save_checkpoint(root, tag="good")
    good = flat_params(engine.module).clone()
    engine.commit_checkpoint()
    _train(engine, rank, 1, seed=5)
    writer = engine._checkpointer.decoupled
    real = writer._save

    def failing(obj: Any, path: Any, **kw: Any) -> None:
        if rank == 1 and "zero_pp_rank_1" in str(path):
            raise OSError(28, "No space left on device (injected)")
        real(obj, path, **kw)

    writer._save = failing
    engine.save_checkpoint(root, tag="bad")  # returns: the failure happens in the background
    _train(engine, rank, 1, seed=6)
    error = None
    try:
        engine.commit_checkpoint()
    except RuntimeError as err:
        error = (type(err).__name__, str(err))
    latest = (Path(root) / "latest").read_text()
    fresh = make_engine(tiny_net(3), CONFIG)
    tag, _ = fresh.load_checkpoint(root)
    loaded_good = torch.equal(flat_params(fresh.module), good)
    writer._save = real
    engine.save_checkpoint(root, tag="after")  # the failure was reported once; the next save works
    engine.commit_checkpoint()
    return {"error": error, "latest": latest, "tag": tag, "loaded_good": loaded_good}


@needs_zero
def test_failed_background_write_keeps_latest_and_is_raised(tmp_path: Path) -> None:
    results = run_ranks(2, _failure_keeps_last_good, root=str(tmp_path), timeout_s=240)
    for rank, r in enumerate(results):
        assert r["error"] is not None and r["error"][0] == "DecoupledCheckpointError", r
        assert "'bad'" in r["error"][1] and "`latest` was not moved" in r["error"][1]
        named = "zero_pp_rank_1_mp_rank_00_optim_states.pt" in r["error"][1]
        assert named if rank == 1 else "rank(s) [1]" in r["error"][1], r["error"]
        assert r["latest"] == "good" and r["tag"].startswith(str(tmp_path / "good")) and r["loaded_good"]
    assert not (tmp_path / "bad" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").exists()
    assert (tmp_path / "latest").read_text() == "after"


def _destroy_finishes(rank: int, world: int, root: str) -> dict[str, Any]:
    engine = make_engine(tiny_net(0), CONFIG)
    _train(engine, rank, 1)
    gate, waited_out = threading.Event(), []
    _gate_writer(engine, gate, waited_out)
    engine.save_checkpoint(root, tag="d")
    latest_before = (Path(root) / "latest").exists()
    threading.Timer(0.5, gate.set).start()  # the writer is still busy when destroy() starts waiting
    engine.destroy()
    return {"latest_before": latest_before, "latest": (Path(root) / "latest").read_text(), "waited": waited_out}


@needs_zero
def test_destroy_finishes_and_commits(tmp_path: Path) -> None:
    for r in run_ranks(2, _destroy_finishes, root=str(tmp_path), timeout_s=180):
        assert not r["latest_before"] and r["latest"] == "d" and r["waited"] and not any(r["waited"])
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        assert torch.load(tmp_path / "d" / name, weights_only=False)


def _exit_with_writes_queued(rank: int, world: int, root: str) -> float:
    engine = make_engine(tiny_net(0), CONFIG)
    _train(engine, rank, 1)
    writer = engine._checkpointer.decoupled
    real = writer._save

    def slow(obj: Any, path: Any, **kw: Any) -> None:
        time.sleep(1.0)  # still writing when the rank function returns and the process starts to exit
        real(obj, path, **kw)

    writer._save = slow
    engine.save_checkpoint(root, tag="x")
    return time.monotonic()


@pytest.mark.filterwarnings("ignore")
@needs_zero
def test_process_exit_finishes_queued_writes(tmp_path: Path) -> None:
    run_ranks(2, _exit_with_writes_queued, root=str(tmp_path), timeout_s=180)
    files = [tmp_path / "x" / f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)]
    files.append(tmp_path / "x" / "mp_rank_00_model_states.pt")
    for path in files:
        assert "optimizer_state_dict" in torch.load(path, weights_only=False) or path.name.startswith("mp_rank")
    assert torch.load(files[-1], weights_only=False)["module"]
    assert not (tmp_path / "latest").exists()  # the process group was gone at exit: no commit


def _standalone_engine(rank: int, world: int, root: str) -> dict[str, Any]:
    import types

    from ds_engine import DeepSpeedConfig
    from ds_engine.runtime.checkpoint_engine import CheckpointCommitInfo, create_checkpoint_engine

    raw = {"train_batch_size": 2, "checkpoint": {"writer": {"io_buffer_size": 8192, "decoupled": True}}}
    engine = create_checkpoint_engine(
        DeepSpeedConfig(raw, world_size=2), types.SimpleNamespace(mpu=None), 0, False, False
    )
    info = CheckpointCommitInfo(tag="s", save_dir=root, save_latest=False)
    engine.create(info)
    engine.save({"rank": rank, "w": torch.full((1000,), float(rank))}, str(Path(root) / "f.pt"))
    committed = engine.commit(info)  # a collective on both ranks, the one that writes nothing too
    engine.create(info)
    engine.save({"w": torch.ones(3)}, str(Path(root) / "missing" / "g.pt"))
    error = None
    try:
        engine.commit(info)
    except RuntimeError as err:
        error = str(err)
    engine.cleanup()
    return {"writer": engine.is_data_parallel_writer(0), "committed": committed, "error": error}


def test_standalone_engine_commits_on_every_rank(tmp_path: Path) -> None:
    results = run_ranks(2, _standalone_engine, root=str(tmp_path), timeout_s=120)
    assert [r["writer"] for r in results] == [True, False] and all(r["committed"] for r in results)
    assert torch.load(tmp_path / "f.pt", weights_only=True)["rank"] == 0  # data-parallel rank 0 wrote it
    assert "missing/g.pt of checkpoint 's' failed" in results[0]["error"]
    assert "rank(s) [0] failed writing files of checkpoint 's'" in results[1]["error"]
