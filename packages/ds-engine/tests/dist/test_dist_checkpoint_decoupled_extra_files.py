"""`checkpoint.writer.decoupled: true`: the files a save writes besides its model and optimizer states (a
pipeline's per-layer files, an MoE model's expert files and, at stage 0, its expert optimizer file) are
queued on the background writer too, as DeepSpeed's decoupled engine queues them (2 gloo ranks).

The writer is held (an injected gate) while the next training step runs: the step returns, none of those
files exists before the commit, and after it each holds what the file of a synchronous save of the same
state wrote (the same keys and values).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero")

WRITER = {"writer": {"io_buffer_size": 8192, "decoupled": True}}


def _gate(engine: Any) -> tuple[threading.Event, list[Path]]:
    """Hold the background writer until the returned event is set; record each path it writes."""
    writer = engine._checkpointer.decoupled
    real, gate, written = writer._save, threading.Event(), []

    def held(obj: Any, path: Any, **kw: Any) -> None:
        gate.wait(60)
        real(obj, path, **kw)
        written.append(Path(path))

    writer._save = held
    return gate, written


def _sync_then_decoupled(engine: Any, root: Path, train_one: Any) -> dict[str, Any]:
    """Save the same state synchronously (reference) and decoupled (held), step, look, release, commit."""
    decoupled = engine._checkpointer.decoupled
    engine._checkpointer.decoupled = None
    engine.save_checkpoint(str(root / "sync"), tag="t")
    engine._checkpointer.decoupled = decoupled
    gate, written = _gate(engine)
    engine.save_checkpoint(str(root / "dec"), tag="t")
    train_one()  # returns while the writer is held
    present = sorted(p.name for p in (root / "dec" / "t").glob("*.pt")) if (root / "dec" / "t").exists() else []
    gate.set()
    committed = engine.commit_checkpoint()
    return {"present_before_commit": present, "committed": committed, "written": sorted(p.name for p in written)}


def _compare(root: Path, extra_glob: str, results: list[dict[str, Any]]) -> list[str]:
    sync, dec = root / "sync" / "t", root / "dec" / "t"
    extra = sorted(p.name for p in sync.glob(extra_glob))
    assert extra, f"the synchronous save wrote no {extra_glob}"
    for r in results:
        assert r["committed"]
        assert not set(extra) & set(r["present_before_commit"]), r["present_before_commit"]
    assert set(extra) <= {name for r in results for name in r["written"]}  # written by the background worker
    for name in extra:  # (not bytes: the synchronous path and the writer name a file's zip records apart)
        a, b = torch.load(sync / name, weights_only=False), torch.load(dec / name, weights_only=False)
        assert _flatten(a).keys() == _flatten(b).keys(), name
        for key, value in _flatten(a).items():
            other = _flatten(b)[key]
            assert torch.equal(value, other) if torch.is_tensor(value) else value == other, f"{name}: {key}"
    return extra


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        return {k: v for key, value in obj.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix: obj}


# -- a 2-stage pipeline --------------------------------------------------------------------------------------
def _pipeline(rank: int, world: int, root: str) -> dict[str, Any]:
    from pipeline_cases import batches, two_stage_engine

    engine = two_stage_engine(checkpoint=WRITER)
    engine.train_batch(batches(0))
    return _sync_then_decoupled(engine, Path(root), lambda: engine.train_batch(batches(1)))


def test_pipeline_layer_files_are_written_in_the_background(tmp_path: Path) -> None:
    pytest.importorskip("ds_pipe")
    results = run_ranks(2, _pipeline, root=str(tmp_path), timeout_s=240)
    assert _compare(tmp_path, "layer_*-model_states.pt", results) == [f"layer_0{i}-model_states.pt" for i in range(4)]


# -- MoE expert files (stage 0 also writes the expert optimizer file) ---------------------------------------
def _moe(rank: int, world: int, root: str, stage: int) -> dict[str, Any]:
    from moe_cases import TinyMoE, batch, config

    import ds_engine as deepspeed

    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(
        model=TinyMoE(ep_size=2), config={**config(stage, 0.3, 1e-2), "checkpoint": WRITER}
    )

    def train_one(step: int = 0) -> None:
        engine.backward(engine(*batch(rank, step)))
        engine.step()

    train_one()
    return _sync_then_decoupled(engine, Path(root), lambda: train_one(1))


@pytest.mark.parametrize("stage", [0, 1])
def test_moe_expert_files_are_written_in_the_background(tmp_path: Path, stage: int) -> None:
    results = run_ranks(2, _moe, root=str(tmp_path), stage=stage, timeout_s=240)
    names = _compare(tmp_path, "*exp*.pt", results)
    assert sum("_expert_" in n for n in names) == 8, names  # 4 experts in each of the 2 MoE layers
    assert any(n.startswith("expp_rank_") for n in names) == (stage == 0), names
