"""`checkpoint.layout: "deepspeed"`: a failed save never replaces the last good one; a re-saved tag is replaced whole.

The DeepSpeed files are built in a staging directory and published with one rename before `latest`
moves (`_deepspeed_layout`). Here the conversion fails after writing part of its files, for a new
tag and for the tag `latest` names: `latest`, the tag directories and what a fresh engine loads stay
those of the last good save, and the next save (which clears the leftover staging directory) succeeds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

import ds_comm
from ds_comm.testing import run_ranks

pytest.importorskip("ds_zero")

CONFIG = base_config(zero_optimization={"stage": 2}, checkpoint={"layout": "deepspeed"})


def _step(engine: Any, step: int) -> None:
    x, y = batches(1, 4, seed=step)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()


def _snapshot(tag_dir: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(tag_dir.iterdir())}


def _failing_saves(rank: int, world: int, root: str) -> dict[str, Any]:
    import ds_zero

    save_dir = Path(root)
    engine = make_engine(tiny_net(seed=0), CONFIG)
    _step(engine, 0)
    engine.save_checkpoint(root, tag="good")
    good = _snapshot(save_dir / "good")
    real = ds_zero.write_deepspeed_files

    def fail_after_writing(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        raise OSError("disk full (injected)")

    _step(engine, 1)
    out: dict[str, Any] = {}
    ds_zero.write_deepspeed_files = fail_after_writing
    try:
        for tag in ("new", "good"):
            with pytest.raises(OSError, match="injected"):
                engine.save_checkpoint(root, tag=tag)
            out[f"after failed {tag!r}"] = {
                "latest": (save_dir / "latest").read_text(),
                "good unchanged": _snapshot(save_dir / "good") == good,
                "new exists": (save_dir / "new").exists(),
            }
    finally:
        ds_zero.write_deepspeed_files = real
    fresh = make_engine(tiny_net(seed=1), CONFIG)
    fresh.load_checkpoint(root)
    out["loaded steps"] = fresh.global_steps
    engine.save_checkpoint(root, tag="good")  # the same tag again, now succeeding: replaced whole
    state = ds_comm.load_checkpoint_file(save_dir / "good" / "mp_rank_00_model_states.pt")
    out["resaved steps"] = state["global_steps"]
    out["leftovers"] = sorted(
        p.name for p in save_dir.iterdir() if p.name not in ("good", "latest", "zero_to_fp32.py", "zero_to_torch.py")
    )
    fresh = make_engine(tiny_net(seed=1), CONFIG)
    fresh.load_checkpoint(root)
    out["params equal after resave"] = all(
        torch.equal(a, b) for a, b in zip(engine.module.parameters(), fresh.module.parameters(), strict=True)
    )
    for tag in ("ds-layout", "deepspeed-layout"):  # the staging directory's own names, as user tags
        engine.save_checkpoint(root, tag=tag)
        out[f"files of {tag}"] = sorted(p.name for p in (save_dir / tag).iterdir())
    out["files of good"] = sorted(p.name for p in (save_dir / "good").iterdir())
    return out


@pytest.mark.timeout(200)
def test_a_failed_deepspeed_layout_save_leaves_the_last_good_one(tmp_path: Path) -> None:
    out = run_ranks(1, _failing_saves, root=str(tmp_path), timeout_s=180)[0]
    for tag in ("new", "good"):
        assert out[f"after failed {tag!r}"] == {"latest": "good", "good unchanged": True, "new exists": False}, tag
    assert out["loaded steps"] == 1
    assert out["resaved steps"] == 2
    assert out["leftovers"] == [], "the staging directory or the replaced tag directory was left behind"
    assert out["files of ds-layout"] == out["files of deepspeed-layout"] == out["files of good"]
    assert out["params equal after resave"]
