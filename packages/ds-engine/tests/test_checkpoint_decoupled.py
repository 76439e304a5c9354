"""`checkpoint.writer.decoupled: true` in one process (2 ranks: tests/dist/test_dist_checkpoint_decoupled.py).

The save's files are a snapshot: the optimizer steps taken while the writer is held do not reach them, and
they equal a synchronous save of the same state byte for byte; `latest` moves at the first step boundary
after the files are written; a load and `save_16bit_model` wait for queued writes; tied weights stay one
storage; a state deepcopy refuses is written at once instead; a script that ends right after a save still
gets the files and `latest` (the exit hook); DeepSpeed's `DecoupledCheckpointEngine` queues a script's files
and its `commit` raises a failed write, naming the file; a DeepSpeed-layout save is built and published at
the commit; REPLICA writes (a collective) are refused with decoupled, naming the key.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine.explain import explain
from ds_engine.runtime.checkpoint_engine import CheckpointCommitInfo
from ds_engine.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine

WRITER = {"io_buffer_size": 8192, "decoupled": True}


def _train(engine: Any, steps: int, seed: int = 1) -> None:
    for x, y in batches(steps, 4, seed=seed):
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if type(a).__module__ == "numpy":  # the RNG states
        return type(a) is type(b) and bool((a == b).all())
    if hasattr(a, "__dict__") and not isinstance(a, type):  # the loss scaler
        return type(a) is type(b) and _same(vars(a), vars(b))
    return bool(a == b)


def _hold(engine: Any) -> threading.Event:
    """Hold the background writer until the returned event is set."""
    gate = threading.Event()
    writer = engine._checkpointer.decoupled
    real = writer._save

    def held(obj: Any, path: Any, **kw: Any) -> None:
        assert gate.wait(60), "the test never released the writer"
        real(obj, path, **kw)

    writer._save = held
    return gate


@pytest.mark.parametrize("writer_type", ["fast", "python"])
def test_snapshot_equals_sync_save_and_latest_moves_at_a_step(tmp_path: Path, writer_type: str) -> None:
    engine = make_engine(
        tiny_net(0), base_config(checkpoint={"writer": {**WRITER, "type": writer_type}, "layout": "ds"})
    )
    _train(engine, 2)
    decoupled, engine._checkpointer.decoupled = engine._checkpointer.decoupled, None
    engine.save_checkpoint(str(tmp_path / "sync"), tag="t")
    engine._checkpointer.decoupled = decoupled
    gate = _hold(engine)
    engine.save_checkpoint(str(tmp_path / "dec"), tag="t")
    _train(engine, 2, seed=3)  # steps while the file is held: their updates must not reach it
    assert not (tmp_path / "dec" / "latest").exists()
    assert engine.checkpoint_engine.get_commit_info() == CheckpointCommitInfo("t", str(tmp_path / "dec"), True)
    gate.set()
    decoupled.drain()
    _train(engine, 1, seed=4)  # the first boundary after the files are written commits
    assert (tmp_path / "dec" / "latest").read_text() == "t" and decoupled.pending is None
    name = "mp_rank_00_model_states.pt"
    assert (tmp_path / "sync" / "t" / name).read_bytes() == (tmp_path / "dec" / "t" / name).read_bytes()
    assert not engine.commit_checkpoint()  # nothing left to commit


def test_load_and_16bit_save_wait_for_queued_writes(tmp_path: Path) -> None:
    engine = make_engine(tiny_net(0), base_config(checkpoint={"writer": WRITER, "layout": "ds"}))
    _train(engine, 1)
    saved = flat_params(engine.module).clone()
    gate = _hold(engine)
    engine.save_checkpoint(str(tmp_path), tag="a")
    threading.Timer(0.2, gate.set).start()
    assert engine.save_16bit_model(str(tmp_path / "hf"))  # the shared staging buffer is free only after the write
    assert (tmp_path / "a" / "mp_rank_00_model_states.pt").is_file()
    _train(engine, 1, seed=2)
    path, _ = engine.load_checkpoint(str(tmp_path))  # commits first, then reads `latest`
    assert path is not None and torch.equal(flat_params(engine.module), saved)
    assert (tmp_path / "latest").read_text() == "a"


def test_tied_weights_stay_one_storage(tmp_path: Path) -> None:
    model = tiny_net(0)
    engine = make_engine(model, base_config(checkpoint={"writer": WRITER, "layout": "ds"}))
    writer = engine._checkpointer.decoupled
    w = torch.arange(12.0)
    writer.save({"a": w, "b": w[4:8]}, tmp_path / "tied.pt")
    writer.flush()
    loaded = torch.load(tmp_path / "tied.pt", weights_only=True)
    assert loaded["a"].untyped_storage().data_ptr() == loaded["b"].untyped_storage().data_ptr()
    assert torch.equal(loaded["b"], w[4:8])
    with open(tmp_path / "plain.pt", "wb") as f:  # through a file object, as the writer saves (same zip names)
        torch.save({"a": w, "b": w[4:8]}, f)
    assert (tmp_path / "plain.pt").read_bytes() == (tmp_path / "tied.pt").read_bytes()
    engine.destroy()


def test_deepspeed_engine_queues_and_commit_names_a_failed_file(tmp_path: Path) -> None:
    config = DeepSpeedConfig({"train_batch_size": 4, "checkpoint": {"writer": WRITER}}, world_size=1)
    ce = DecoupledCheckpointEngine(config, dp_writer_config=True)
    assert ce.is_decoupled() and ce.is_data_parallel_writer(0) and ce.name == "DecoupledCheckpointEngine"
    info = CheckpointCommitInfo(tag="s", save_dir=str(tmp_path), save_latest=False)
    ce.create(info)
    state = {"w": torch.arange(10_000)}
    ce.save(state, str(tmp_path / "x.pt"))
    state["w"].zero_()  # the queued file is the state at save time
    ce.save({"v": 1}, str(tmp_path / "missing_dir" / "y.pt"))  # no such directory: the write fails
    with pytest.raises(ValueError, match="commit info mismatch"):
        ce.commit(CheckpointCommitInfo(tag="other", save_dir=str(tmp_path), save_latest=False))
    with pytest.raises(RuntimeError, match=r"writing .*missing_dir/y.pt of checkpoint 's' failed"):
        ce.commit(info)
    assert torch.equal(ce.load(str(tmp_path / "x.pt"))["w"], torch.arange(10_000))
    assert not (tmp_path / "missing_dir").exists()
    ce.cleanup()
    silent = DecoupledCheckpointEngine(config, dp_writer_config=None)
    silent.save({"v": 1}, str(tmp_path / "z.pt"))
    assert silent.commit(info) and not (tmp_path / "z.pt").exists() and not silent.is_data_parallel_writer(0)


@pytest.mark.parametrize(
    "stage",
    [
        0,
        pytest.param(  # ZeRO-1; reading DeepSpeed's files back unpickles deepspeed.* objects
            1,
            marks=pytest.mark.skipif(
                importlib.util.find_spec("ds_zero") is None or importlib.util.find_spec("deepspeed") is None,
                reason="needs ds-zero and the deepspeed distribution",
            ),
        ),
    ],
)
def test_deepspeed_layout_is_built_and_published_at_the_commit(tmp_path: Path, stage: int) -> None:
    config = base_config(checkpoint={"writer": WRITER, "layout": "deepspeed"}, zero_optimization={"stage": stage})
    engine = make_engine(tiny_net(0), config)
    _train(engine, 2)
    decoupled, engine._checkpointer.decoupled = engine._checkpointer.decoupled, None
    engine.save_checkpoint(str(tmp_path / "sync"), tag="t")
    engine._checkpointer.decoupled = decoupled
    gate = _hold(engine)
    engine.save_checkpoint(str(tmp_path / "dec"), tag="t")
    _train(engine, 1, seed=3)
    assert not (tmp_path / "dec" / "t").exists() and not (tmp_path / "dec" / "latest").exists()
    gate.set()
    assert engine.commit_checkpoint()
    assert (tmp_path / "dec" / "latest").read_text() == "t"
    names = sorted(p.name for p in (tmp_path / "sync" / "t").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "dec" / "t").iterdir()) and names
    for name in names:
        a, b = (tmp_path / "sync" / "t" / name), (tmp_path / "dec" / "t" / name)
        if stage == 0:
            assert a.read_bytes() == b.read_bytes(), name
        else:  # DeepSpeed's files built from ZeRO partitions differ in byte order between two synchronous saves too
            assert _same(torch.load(a, weights_only=False), torch.load(b, weights_only=False)), name
    assert not list((tmp_path / "dec").glob(".*staging"))


def test_refused_combinations_name_the_key(tmp_path: Path) -> None:
    with pytest.raises(DeepSpeedConfigError, match=r"checkpoint.writer: decoupled=true with data_parallel='REPLICA'"):
        DeepSpeedConfig(
            {"train_batch_size": 4, "checkpoint": {"writer": {"decoupled": True, "data_parallel": "replica"}}},
            world_size=1,
        )
    out = explain(DeepSpeedConfig({"train_batch_size": 4, "checkpoint": {"writer": WRITER}}, world_size=1))
    assert "decoupled: a background worker writes a snapshot" in out


def test_snapshot_pool_reuses_the_last_saves_memory() -> None:
    from ds_engine._checkpoint.snapshot import SnapshotPool

    pool = SnapshotPool()
    flat = torch.arange(20.0)
    state = {"a": flat[:10], "b": flat[10:], "opt": [{"m": torch.ones(3)}], "step": 4}
    copy1, used1 = pool.snapshot(state)
    assert copy1["a"].untyped_storage().data_ptr() == copy1["b"].untyped_storage().data_ptr()  # still one buffer
    assert copy1["b"].storage_offset() == 10 and torch.equal(copy1["b"], flat[10:]) and copy1["step"] == 4
    pool.give_back(used1)
    pointers = {s.data_ptr() for s in used1}
    flat.add_(1)
    copy2, used2 = pool.snapshot(state)
    assert {s.data_ptr() for s in used2} == pointers  # the same memory, refilled
    assert torch.equal(copy2["a"], flat[:10]) and torch.equal(copy2["opt"][0]["m"], torch.ones(3))
    pool.give_back(used2)
    pool.trim()  # both used since the last trim: kept
    _, used3 = pool.snapshot({"other": torch.zeros(7)})
    pool.give_back(used3)
    pool.trim()  # the first state's storages were not used this round: dropped, the 7-float one kept
    assert {key: len(free) for key, free in pool._free.items()} == {(28, "cpu"): 1}


def test_a_process_that_exits_after_a_save_finishes_and_commits_it(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from pathlib import Path
        from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net
        engine = make_engine(tiny_net(0), base_config(checkpoint={{"writer": {WRITER!r}, "layout": "ds"}}))
        for x, y in batches(1, 4):
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        writer = engine._checkpointer.decoupled
        real = writer._save
        def slow(obj, path, **kw):
            time.sleep(1.0)  # still writing when the script ends
            real(obj, path, **kw)
        writer._save = slow
        engine.save_checkpoint({str(tmp_path)!r}, tag="end")
        print("saved", Path({str(tmp_path)!r}, "latest").exists())
        """
    )
    tests_dir = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": tests_dir + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "saved False" in out.stdout  # the script ended before the commit
    assert (tmp_path / "latest").read_text() == "end"  # the exit hook finished the write and committed it
    assert torch.load(tmp_path / "end" / "mp_rank_00_model_states.pt", weights_only=False)["module"]


def test_a_state_that_cannot_be_copied_is_written_at_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine(tiny_net(0), base_config(checkpoint={"writer": WRITER, "layout": "ds"}))
    _train(engine, 1)
    grad_tracking = torch.ones(3, requires_grad=True) * 2  # a non-leaf tensor: deepcopy refuses it, torch.save not
    with caplog.at_level("WARNING", logger="ds_engine._checkpoint.decoupled"):
        engine.save_checkpoint(str(tmp_path), tag="c", client_state={"scaled": grad_tracking})
    assert "cannot be snapshot" in caplog.text
    saved = torch.load(tmp_path / "c" / "mp_rank_00_model_states.pt", weights_only=False)  # written before return
    assert torch.equal(saved["scaled"].detach(), torch.full((3,), 2.0))
    assert engine.commit_checkpoint() and (tmp_path / "latest").read_text() == "c"
