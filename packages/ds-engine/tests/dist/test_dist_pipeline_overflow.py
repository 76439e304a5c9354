"""PipelineEngine: an inf gradient on one stage of one replica skips the step on every stage of every replica.

2 stages x 2 replicas on 4 gloo ranks, stage 0 (bf16, fp16) and ZeRO-1 (bf16): the skip decision is
agreed once over the grid and handed to each stage's stepper (`Stepper.step(skip=...)`). No rank's
weights move in the skipped step, `skipped_steps` is 1 everywhere, and the step after it lands on
exactly the weights of a run that never saw the bad batch.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_pipe")

D, H, OUT, ROWS, GAS = 6, 10, 3, 3, 2
CASES = {
    "bf16_stage0": ({"bf16": {"enabled": True}}, 0),
    "fp16_stage0": ({"fp16": {"enabled": True, "initial_scale_power": 8}}, 0),
    "bf16_zero1": ({"bf16": {"enabled": True}}, 1),
}


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _engine(precision: dict[str, Any], zero: int) -> Any:
    import ds_engine
    from ds_pipe import LayerSpec, PipeDataParallelTopology, PipelineModule

    layers = [
        LayerSpec(nn.Linear, D, H),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, H, H),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, H, OUT),
    ]
    module = PipelineModule(
        layers,
        topology=PipeDataParallelTopology(num_pp=2, num_dp=2),
        loss_fn=_mse,
        seed_layers=True,
        base_seed=7,
        partition_method=[0, 2, 5],
    )
    config = {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        **copy.deepcopy(precision),
    }
    engine, *_ = ds_engine.initialize(model=module, config=config)
    return engine


def _data(step: int, replica: int) -> Any:
    g = torch.Generator().manual_seed(1000 * step + replica)
    return iter([(torch.randn(ROWS, D, generator=g), torch.randn(ROWS, OUT, generator=g)) for _ in range(GAS)])


def _weights(engine: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in engine.module.parameters()]


def _run(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (precision, zero) in CASES.items():
        engine = _engine(precision, zero)
        replica = engine.get_data_parallel_rank()
        poison = {"on": False}
        if engine.is_first_stage() and replica == 1:  # one stage of one replica only
            first = next(engine.module.parameters())
            first.register_hook(lambda g, poison=poison: g.clone().fill_(float("inf")) if poison["on"] else g)
        engine.train_batch(_data(0, replica))
        before = _weights(engine)
        poison["on"] = True
        engine.train_batch(_data(1, replica))
        poison["on"] = False
        unchanged = all(torch.equal(a, b) for a, b in zip(before, _weights(engine), strict=True))
        skipped = (engine.skipped_steps, engine.was_step_applied())
        engine.train_batch(_data(2, replica))
        reference = _engine(precision, zero)
        for step in (0, 2):
            reference.train_batch(_data(step, replica))
        same = all(torch.equal(a, b) for a, b in zip(_weights(engine), _weights(reference), strict=True))
        out[name] = {
            "unchanged": unchanged,
            "skipped": skipped,
            "after": engine.skipped_steps,
            "same_as_reference": same,
            "stage": engine.stage_id,
            "replica": replica,
        }
    return out


def test_one_bad_stage_skips_every_stage_and_replica() -> None:
    results = run_ranks(4, _run, timeout_s=240)
    for rank, r in enumerate(results):
        for name, case in r.items():
            where = f"{name} rank {rank} (stage {case['stage']}, replica {case['replica']})"
            assert case["skipped"] == (1, False), where
            assert case["unchanged"], f"{where}: weights moved in the skipped step"
            assert case["after"] == 1, where
            assert case["same_as_reference"], f"{where}: differs from the run without the bad batch"
