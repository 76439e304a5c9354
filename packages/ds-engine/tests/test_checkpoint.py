"""Checkpoints on one rank: DeepSpeed's layout and keys, round trips (fp32, bf16 masters), crash safety."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

import ds_engine._checkpoint.checkpoint
from ds_comm.testing import RankFailedError, file_events, run_ranks

SCHED = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}


def _trained(steps: int = 2, **cfg: object):
    model = tiny_net(0)
    engine = make_engine(model, base_config(scheduler=SCHED, **cfg))
    dtype = next(model.parameters()).dtype
    for x, y in batches(steps, 4):
        engine.backward(loss_fn(engine(x.to(dtype)), y))
        engine.step()
    return engine, model


def test_layout_keys_and_round_trip(tmp_path: Path) -> None:
    engine, model = _trained()
    assert engine.save_checkpoint(str(tmp_path), client_state={"my": 1}) is True
    assert (tmp_path / "latest").read_bytes() == b"global_step2"  # no trailing newline, as DeepSpeed
    assert sorted(p.name for p in (tmp_path / "global_step2").iterdir()) == ["mp_rank_00_model_states.pt"]
    state = torch.load(tmp_path / "global_step2" / "mp_rank_00_model_states.pt", weights_only=False)
    for key in (
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "checkpoint_parallel_dimensions",
        "ds_config",
        "ds_version",
        "my",
    ):
        assert key in state, key
    assert state["lr_scheduler"] == {"last_batch_iteration": 1} and state["global_samples"] == 8
    assert state["buffer_names"] == ["buf"] and state["ds_config"]["scheduler"] == SCHED
    # DeepSpeed's pp/tp degrees, and ds's sequence-parallel degree (ZeRO partitions over dp x sp ranks).
    assert state["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": 1, "sp_degree": 1}

    fresh_model = tiny_net(5)
    fresh = make_engine(fresh_model, base_config(scheduler=SCHED))
    path, client = fresh.load_checkpoint(str(tmp_path))
    assert path.endswith("global_step2/mp_rank_00_model_states.pt")
    assert client["my"] == 1 and "ds_config" in client and "module" not in client and "optimizer" not in client
    assert torch.equal(flat_params(fresh_model), flat_params(model))
    assert (fresh.global_steps, fresh.global_samples, fresh.micro_steps) == (2, 8, 2)
    assert fresh.lr_scheduler.last_batch_iteration == 1 and fresh.get_lr() == engine.get_lr()
    a, b = engine.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert all(torch.equal(a["state"][0][k], b["state"][0][k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_bf16_checkpoint_restores_fp32_masters_and_loss_scaler(tmp_path: Path) -> None:
    engine, _ = _trained(steps=3, bf16={"enabled": True})
    engine.save_checkpoint(str(tmp_path), tag="bf")
    state = torch.load(tmp_path / "bf" / "mp_rank_00_model_states.pt", weights_only=False)
    assert state["module"]["l1.weight"].dtype == torch.bfloat16 and state["module"]["buf"].dtype == torch.float32
    assert set(state["optimizer"]) >= {
        "dynamic_loss_scale",
        "cur_scale",
        "optimizer_state_dict",
        "fp32_groups",
        "loss_scaler",
    }
    fresh = make_engine(tiny_net(7), base_config(scheduler=SCHED, bf16={"enabled": True}))
    fresh.load_checkpoint(str(tmp_path), tag="bf")
    for mine, theirs in zip(engine.optimizer.masters, fresh.optimizer.masters, strict=True):
        assert theirs.dtype == torch.float32 and torch.equal(mine, theirs)
    only_module = make_engine(tiny_net(7), base_config(scheduler=SCHED, bf16={"enabled": True}))
    only_module.load_checkpoint(str(tmp_path), tag="bf", load_module_only=True)
    assert only_module.global_steps == 0
    for mine, theirs in zip(engine.optimizer.masters, only_module.optimizer.masters, strict=True):
        assert torch.equal(mine.bfloat16().float(), theirs)  # masters re-derived from the bf16 module weights


def test_save_16bit_model_writes_the_module_in_training_dtype(tmp_path: Path) -> None:
    engine, model = _trained(bf16={"enabled": True})
    assert engine.save_16bit_model(str(tmp_path / "out")) is True
    state = torch.load(tmp_path / "out" / "pytorch_model.bin")
    assert state["l2.bias"].dtype == torch.bfloat16 and torch.equal(state["l2.bias"], model.l2.bias.detach())
    assert state["buf"].dtype == torch.float32
    assert engine.save_fp16_model == engine.save_16bit_model


def test_load_without_latest_warns_and_returns_none(tmp_path: Path, caplog) -> None:
    engine, _ = _trained()
    with caplog.at_level(logging.WARNING):
        assert engine.load_checkpoint(str(tmp_path)) == (None, None)
    assert "no 'latest' file" in caplog.text
    with pytest.raises(FileNotFoundError, match="does not exist"):
        engine.load_checkpoint(str(tmp_path), tag="missing")


def test_a_save_from_another_data_x_sequence_layout_is_reported_not_refused(tmp_path: Path, caplog) -> None:
    engine, model = _trained()
    engine.save_checkpoint(str(tmp_path))
    path = tmp_path / "global_step2" / "mp_rank_00_model_states.pt"
    fresh_model = tiny_net(5)
    fresh = make_engine(fresh_model, base_config(scheduler=SCHED))

    def load(dp_world_size: int, sp_degree: int | None) -> str:
        state = torch.load(path, weights_only=False)
        state["dp_world_size"] = dp_world_size
        state["checkpoint_parallel_dimensions"].pop("sp_degree", None)
        if sp_degree is not None:
            state["checkpoint_parallel_dimensions"]["sp_degree"] = sp_degree
        torch.save(state, path)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ds_engine._checkpoint.checkpoint"):
            assert fresh.load_checkpoint(str(tmp_path))[0] == str(path)
        assert torch.equal(flat_params(fresh_model), flat_params(model))
        return caplog.text

    assert "re-partitions" not in load(1, 1)  # this run's layout
    # As if saved at SP=2 x DP=2 (four ZeRO partitions); this run has one rank and no sequence parallelism.
    assert "saved on 4 data x sequence ranks (sp_degree 2), this run has 1 (sp_degree 1)" in load(4, 2)
    assert "re-partitions" not in load(1, None)  # DeepSpeed's files do not record sp
    assert "sp_degree unrecorded" in load(2, None)


def test_bad_arguments(tmp_path: Path) -> None:
    engine, _ = _trained()
    with pytest.raises(ValueError, match="save_dir must be a directory path"):
        engine.save_checkpoint("")
    with pytest.raises(ValueError, match=r"client_state keys \['global_steps'\] collide"):
        engine.save_checkpoint(str(tmp_path), client_state={"global_steps": 3})
    with pytest.raises(ValueError, match="tag must be a plain directory name"):
        engine.save_checkpoint(str(tmp_path), tag="a/b")


def _crash_during_save(rank: int, world: int, save_dir: str, where: str) -> None:
    engine, _ = _trained(steps=2)
    engine.save_checkpoint(save_dir, tag="good")
    for x, y in batches(2, 4, seed=9):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    if where == "mid-file":

        def die_unsynced(event, path):
            if event == "fsync":  # the temporary file holds the data, nothing is synced or renamed yet
                os._exit(17)

        with file_events(die_unsynced):
            engine.save_checkpoint(save_dir, tag="bad")
    else:

        def die(path, text):
            os._exit(17)

        ds_engine._checkpoint.checkpoint.atomic_write_text = die
        engine.save_checkpoint(save_dir, tag="bad")


@pytest.mark.parametrize("where", ["mid-file", "before-latest"])
def test_a_save_killed_midway_leaves_latest_on_the_previous_tag(tmp_path: Path, where: str) -> None:
    with pytest.raises(RankFailedError, match="exited with code 17"):
        run_ranks(1, _crash_during_save, save_dir=str(tmp_path), where=where, timeout_s=60)
    assert (tmp_path / "latest").read_text() == "good"
    final = sorted(p.name for p in (tmp_path / "bad").iterdir() if not p.name.startswith("."))
    assert final == ([] if where == "mid-file" else ["mp_rank_00_model_states.pt"])
    engine = make_engine(tiny_net(3), base_config(scheduler=SCHED))
    path, _ = engine.load_checkpoint(str(tmp_path))
    assert "/good/" in path and engine.global_steps == 2


def test_micro_steps_saved_at_another_accumulation_count_are_rederived() -> None:
    """A checkpoint saved at gas 1 (micro_steps 3) loaded at gas 2: the boundary must stay on whole batches."""
    from ds_engine._checkpoint.train_state import restored_counters

    saved = {"global_steps": 3, "micro_steps": 3, "global_samples": 12}
    assert restored_counters(saved, train_batch_size=4, gradient_accumulation_steps=2).micro_steps == 6
    assert restored_counters(saved, train_batch_size=4, gradient_accumulation_steps=1).micro_steps == 3
    kept = restored_counters({"global_steps": 3, "micro_steps": 8}, train_batch_size=4, gradient_accumulation_steps=4)
    assert (kept.micro_steps, kept.global_samples) == (8, 12)
