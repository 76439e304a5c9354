"""Tensor and sequence parallelism from the config in one job: `"tensor_parallel": {"autotp_size": 2}` with
`"sequence_parallel_size": 2` on 4 ranks builds one mesh (tp x sp), AutoTP cuts the attention heads and the MLP,
and Ulysses `DistributedAttention` spreads each rank's heads over its sequence peers. Under ZeRO 1 and 2 with
gradient clipping that binds, the losses and whole weights equal plain PyTorch training of the same model on
the same global batches (fp32, 1e-5).

Also: the degrees must divide the world (refused by key before any group is built); a client mpu wins over
the config's degrees, and a disagreement names both; the batch triple is resolved once, for the replicas the
degrees leave (a triple valid only for them used to be refused against the whole world); a TP x SP
checkpoint resumes exactly.

Needs ds-parallel (the `ds-engine[all]` session); skipped without it.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="tensor and sequence parallelism need ds-parallel")
pytest.importorskip("ds_zero", reason="the TP x SP runs train at ZeRO stages 1 and 2: need ds-zero")

STEPS = 5
BATCH, SEQ = 2, 8
LR, MOMENTUM, CLIP = 0.05, 0.9, 0.5
from tp_sp_block import SPECS, Block, D, causal_attention  # noqa: E402 - tests/dist is on the path


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(D, D)  # no spec matches: whole on every rank
        self.block = Block()
        self.head = nn.Linear(D, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.block(self.embed(x))), y)  # mean over this rank's tokens


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, SEQ, D, generator=g), torch.randn(BATCH, SEQ, 1, generator=g)


def _config(stage: int, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_clipping": CLIP,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": MOMENTUM}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "tensor_parallel": {"autotp_size": 2, "partition_config": {"use_default_specs": False, "layer_specs": SPECS}},
        "sequence_parallel_size": 2,
        **extra,
    }


def _engine(stage: int, seed: int = 0) -> tuple[Any, Model, slice]:
    """The TP2 x SP2 engine, its model (Ulysses attention over the sequence group) and this rank's token slice."""
    import ds_engine as deepspeed
    from ds_parallel import DistributedAttention, groups

    torch.manual_seed(seed)
    model = Model()
    engine, *_ = deepspeed.initialize(model=model, config=_config(stage))
    sp_group, sp_rank = groups._get_sequence_parallel_group(), groups._get_sequence_parallel_rank()
    ulysses = DistributedAttention(causal_attention, sp_group, scatter_idx=2, gather_idx=1)
    model.block.attention = functools.partial(ulysses, batch_dim_idx=0)  # [b, s, h, d]
    return engine, model, slice(sp_rank * SEQ // 2, (sp_rank + 1) * SEQ // 2)  # this rank's slice of each sequence


def _steps(engine: Any, piece: slice, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x, y = _data(step)
        loss = engine(x[:, piece], y[:, piece])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _train(rank: int, world: int, stage: int) -> dict[str, Any]:
    from ds_parallel import groups

    engine, model, piece = _engine(stage)
    sp_rank = groups._get_sequence_parallel_rank()
    losses = _steps(engine, piece, range(STEPS))
    return {
        "losses": losses,
        "full": {k: v.clone() for k, v in engine.module_state_dict().items()},
        "q_rows": model.block.q_proj.weight.shape[0],
        "sizes": (engine.dp_world_size, engine._dist.sp_world_size, engine._dist.mp_world_size),
        "train_batch_size": engine.train_batch_size(),
        "sp_rank": sp_rank,
    }


def _reference() -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same model in plain PyTorch on the whole sequences: SGD with momentum, the norm clipped."""
    torch.manual_seed(0)
    model = Model()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    losses = []
    for step in range(STEPS):
        x, y = _data(step)
        loss = model(x, y)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        assert norm > CLIP  # the clipping binds: the tensor x sequence parallel norm is tested too
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("stage", [1, 2])
def test_tp2_by_sp2_equals_plain_training(stage: int) -> None:
    ref_losses, ref_state = _reference()
    results = run_ranks(4, _train, stage, timeout_s=300)
    for rank, r in enumerate(results):
        assert r["sizes"] == (2, 2, 2)  # data x sequence ranks reduce gradients; two-way tensor parallel
        assert r["train_batch_size"] == BATCH and r["q_rows"] == D // 2
        assert r["sp_rank"] == rank // 2  # mesh layout: a tensor-parallel group is consecutive ranks
    for r in results:
        for k, v in ref_state.items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-5, atol=1e-5, msg=k)
    for step in range(STEPS):  # each sequence half's mean loss; equal halves average to the whole mean
        mean = sum(results[rank]["losses"][step] for rank in (0, 2)) / 2
        assert abs(mean - ref_losses[step]) < 1e-5, (step, mean, ref_losses[step])
        assert results[0]["losses"][step] == results[1]["losses"][step]  # tensor-parallel peers agree


def _resume(rank: int, world: int, save_dir: str, load: bool) -> list[float]:
    engine, _, piece = _engine(2, seed=7 if load else 0)  # the resumed run starts from other weights
    if load:
        engine.load_checkpoint(save_dir, tag="mid")
        return _steps(engine, piece, range(2, STEPS))
    first = _steps(engine, piece, range(2))
    engine.save_checkpoint(save_dir, tag="mid")
    return first + _steps(engine, piece, range(2, STEPS))


@pytest.mark.timeout(600)
def test_tp2_by_sp2_checkpoint_resumes(tmp_path: Any) -> None:
    straight = run_ranks(4, _resume, str(tmp_path), False, timeout_s=300)
    resumed = run_ranks(4, _resume, str(tmp_path), True, timeout_s=300)
    for a, b in zip(straight, resumed, strict=True):
        assert a[2:] == b  # weights, momentum and counters come back exactly


def _refused(rank: int, world: int) -> str:
    import ds_engine as deepspeed

    try:
        deepspeed.initialize(model=Model(), config=_config(1))
    except ValueError as err:
        return str(err)
    return "no error"


def test_degrees_that_do_not_divide_the_world_are_refused_by_key() -> None:
    for msg in run_ranks(2, _refused, timeout_s=120):
        assert "tensor_parallel.autotp_size=2 and sequence_parallel_size=2: a model replica spans 2 x 2 = 4" in msg
        assert "does not divide the world size 2" in msg


def _client_mpu(rank: int, world: int, mpu_sp: int) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_parallel import MeshMPU, groups

    mpu = MeshMPU(groups.initialize_mesh(tp=2, sp=mpu_sp))
    torch.manual_seed(0)
    try:
        engine, *_ = deepspeed.initialize(model=Model(), config=_config(1), mpu=mpu)
    except ValueError as err:
        return {"error": str(err)}
    return {"mpu": engine._client.mpu is mpu, "sizes": (engine._dist.sp_world_size, engine._dist.mp_world_size)}


def test_a_client_mpu_wins_and_a_disagreement_names_both() -> None:
    for r in run_ranks(4, _client_mpu, 2, timeout_s=300):
        assert r == {"mpu": True, "sizes": (2, 2)}
    for r in run_ranks(2, _client_mpu, 1, timeout_s=120):
        assert "sequence_parallel_size=2 in the config but the mpu's sequence-parallel world size is 1" in r["error"]


def _triple_for_replicas(rank: int, world: int) -> tuple[int, int, int]:
    import ds_engine as deepspeed

    config = {**_config(1), "train_batch_size": 2, "train_micro_batch_size_per_gpu": 2, "sequence_parallel_size": 1}
    config["gradient_accumulation_steps"] = 1
    torch.manual_seed(0)
    engine, *_ = deepspeed.initialize(model=Model(), config=config)
    return engine.train_batch_size(), engine.train_micro_batch_size_per_gpu(), engine.dp_world_size


def test_the_batch_triple_is_resolved_for_the_replicas_only() -> None:
    """2 ranks at autotp_size=2 are 1 replica: 2 = 2 x 1 x 1 (against the 2 ranks it would need 4)."""
    for r in run_ranks(2, _triple_for_replicas, timeout_s=120):
        assert r == (2, 2, 1)
