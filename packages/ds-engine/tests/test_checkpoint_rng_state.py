"""RNG state across a save and a load: ds's layout restores it, DeepSpeed's leaves it alone.

DeepSpeed 0.19.8's checkpoint files hold no RNG state, and its `load_checkpoint` does not touch the RNG, so
a program that resumes draws its data order and dropout masks from whatever its own seeding left
(HelloDeepSpeed's BERT: the batches after a resume follow from `torch.manual_seed(42)` at start-up). ds's own
layout saves every rank's RNG so that a resumed run continues exactly; DeepSpeed's layout (the `deepspeed`
distribution's default) must not, or such a program trains on other batches than under DeepSpeed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from ds_engine_testkit import base_config, make_engine, tiny_net

from ds_engine.config import default_checkpoint_layout, set_default_checkpoint_layout


@pytest.fixture(autouse=True)
def ds_engine_default() -> Iterator[None]:
    before = default_checkpoint_layout()
    set_default_checkpoint_layout("ds")
    try:
        yield
    finally:
        set_default_checkpoint_layout(before)


def _draws() -> tuple[float, float]:
    return torch.rand(1).item(), random.random()


def _save_then_load(tmp_path: Path, layout: str) -> tuple[tuple[float, float], tuple[float, float], dict]:
    """Save at one RNG state, move the RNG on, load; return (the draws after the save, after the load, the
    saved model-states dict)."""
    config = base_config(checkpoint={"layout": layout})
    torch.manual_seed(7)
    random.seed(7)
    engine = make_engine(tiny_net(), config)
    engine.save_checkpoint(str(tmp_path), tag="t")
    after_save = _draws()
    torch.manual_seed(123)  # a fresh process's seeding, as a resumed program does before it loads
    random.seed(123)
    engine.load_checkpoint(str(tmp_path), tag="t")
    after_load = _draws()
    saved = torch.load(tmp_path / "t" / "mp_rank_00_model_states.pt", weights_only=False)
    return after_save, after_load, saved


def test_ds_layout_restores_the_rng_of_the_save(tmp_path: Path) -> None:
    after_save, after_load, saved = _save_then_load(tmp_path, "ds")
    assert "rng_states" in saved
    assert after_load == after_save


def test_deepspeed_layout_saves_no_rng_and_leaves_the_rng_alone(tmp_path: Path) -> None:
    after_save, after_load, saved = _save_then_load(tmp_path, "deepspeed")
    assert "rng_states" not in saved  # DeepSpeed 0.19.8's model-states file has no such key
    torch.manual_seed(123)
    random.seed(123)
    assert after_load == _draws()  # the program's own seeding decides, as under DeepSpeed
    assert after_load != after_save
