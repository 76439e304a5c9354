"""Stage 0: a checkpoint saved by the route ds took for the config's Adam on a CPU host before (DeepSpeedCPUAdam:
per-parameter `step`, fp32 moments) loads into today's route (ds_ops.FusedAdam) and training goes on as one
uninterrupted torch.optim.AdamW run on the same data (fp32 weights within rtol=1e-5, atol=1e-6)."""

from __future__ import annotations

import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

import ds_ops

LR, WEIGHT_DECAY, STEPS = 1e-2, 0.05, 6


def _reference() -> torch.Tensor:
    model = tiny_net(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    for x, y in batches(STEPS, 4):
        loss_fn(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(model)


def _train(engine, data) -> None:
    for x, y in data:
        engine.backward(loss_fn(engine(x), y))
        engine.step()


def test_stage0_checkpoint_of_the_cpu_adam_route_resumes_under_fused_adam(tmp_path) -> None:
    data = batches(STEPS, 4)
    model = tiny_net(0)
    old_optimizer = ds_ops.DeepSpeedCPUAdam(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY, adamw_mode=True)
    old = make_engine(model, base_config(optimizer=None), optimizer=old_optimizer)
    _train(old, data[: STEPS // 2])
    old.save_checkpoint(str(tmp_path))

    config = base_config(optimizer={"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}})
    resumed_model = tiny_net(7)  # another init: the weights must come from the checkpoint
    new = make_engine(resumed_model, config)
    assert type(new.optimizer) is ds_ops.FusedAdam
    path, _ = new.load_checkpoint(str(tmp_path))
    assert path is not None and new.global_steps == STEPS // 2
    _train(new, data[STEPS // 2 :])
    torch.testing.assert_close(flat_params(resumed_model), _reference(), rtol=1e-5, atol=1e-6)
    assert {int(state["step"]) for state in new.optimizer.state.values()} == {STEPS}
