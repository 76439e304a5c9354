"""The engine on one CUDA device, world size 1: ZeRO stages 0-3, fp16/bf16, ZeRO-Offload and ZeRO-3 parameter offload.

Every run is compared with plain PyTorch on the same device and data:
  * fp32, stages 0-3 (gradient accumulation 2, clipping 1.0): losses and weights equal plain torch
    (`torch.optim.AdamW(fused=True)`, the engine's own base optimizer on CUDA) to 1e-5;
  * ZeRO-Offload (stage 2, optimizer on pinned host memory, ds-ops' CPU Adam) equals the same model
    without offload to 1e-5 (two Adam implementations in fp32: rounding only);
  * ZeRO-3 with parameters offloaded to CPU or to NVMe (pinned aio buffers) equals stage 3 without
    offload to 1e-6 (the same optimizer on the same values: only where the shards live differs);
  * fp16 with dynamic loss scaling: a real overflow (initial scale 2**20) skips steps without
    touching the weights and halves the scale each time; the applied steps then track fp32 plain
    torch trained on the same batches (difference under 3e-3 of the weights' norm);
  * bf16 equals a plain-torch emulation (bf16 model, fp32 masters, fused AdamW on the masters) to 1e-5.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

ds_zero = pytest.importorskip("ds_zero", reason="ZeRO through the engine needs ds-zero: pip install 'ds-engine[zero]'")

DEVICE = "cuda"
VOCAB, WIDTH = 96, 64


class TiedLM(nn.Module):
    """Embedding tied to the output head (stage 3 partitions a shared parameter), a GELU MLP, a LayerNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.body = nn.Sequential(
            nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH), nn.LayerNorm(WIDTH)
        )
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.body(self.emb(idx)))
        return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), target.reshape(-1))


def _model() -> TiedLM:
    torch.manual_seed(0)
    return TiedLM()


def _tokens(steps: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (steps, 4, 9), generator=torch.Generator().manual_seed(1))


def _config(stage: int, *, gas: int = 1, clip: float = 0.0, **extra: Any) -> dict[str, Any]:
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2 * VOCAB * WIDTH)
    if stage in (1, 2):
        zero.update(reduce_bucket_size=4 * WIDTH * WIDTH)
    zero.update(extra.pop("zero", {}))
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": gas,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        **extra,
    }


def _weights(engine: Any) -> torch.Tensor:
    params = list(engine.module.parameters())
    with ds_zero.GatheredParameters(params) if any(hasattr(p, "ds_id") for p in params) else _nothing():
        return torch.cat([p.detach().float().reshape(-1).cpu() for p in params])


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _train_engine(config: dict[str, Any], steps: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    import ds_engine

    engine, *_ = ds_engine.initialize(model=_model(), config=copy.deepcopy(config), dist_init_required=False)
    assert engine.device.type == DEVICE
    tokens, losses = _tokens(steps), []
    for micro in range(steps):
        idx = tokens[micro].to(DEVICE)
        loss = engine(idx[:, :-1], idx[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return torch.tensor(losses), _weights(engine), engine


def _train_torch(steps: int, gas: int = 1, clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    model = _model().to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    tokens, losses = _tokens(steps), []
    for micro in range(steps):
        idx = tokens[micro].to(DEVICE)
        loss = model(idx[:, :-1], idx[:, 1:])
        (loss / gas).backward()
        losses.append(loss.item())
        if (micro + 1) % gas == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return torch.tensor(losses), torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_plain_torch(stage: int) -> None:
    losses, weights, engine = _train_engine(_config(stage, gas=2, clip=1.0), steps=12)
    ref_losses, ref_weights = _train_torch(steps=12, gas=2, clip=1.0)
    assert engine.global_steps == 6 and engine.skipped_steps == 0
    torch.testing.assert_close(losses, ref_losses, rtol=1e-5, atol=1e-5, msg=f"stage {stage} losses")
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-5, msg=f"stage {stage} weights")


def test_zero_offload_with_cpu_adam_matches_no_offload() -> None:
    offload = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
    losses, weights, engine = _train_engine(_config(2, zero=offload), steps=8)
    assert type(engine.basic_optimizer).__name__ == "DeepSpeedCPUAdam"
    masters = engine.optimizer.masters
    assert all(m.device.type == "cpu" and (DEVICE == "cpu" or m.is_pinned()) for m in masters)
    assert next(engine.module.parameters()).device.type == DEVICE
    plain_losses, plain_weights, _ = _train_engine(_config(2), steps=8)
    torch.testing.assert_close(losses, plain_losses, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weights, plain_weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("where", ["cpu", "nvme"])
def test_zero3_parameter_offload_matches_no_offload(where: str, tmp_path: Path) -> None:
    offload: dict[str, Any] = {"device": where, "pin_memory": True}
    extra: dict[str, Any] = {}
    if where == "nvme":
        offload.update(nvme_path=str(tmp_path), buffer_count=4, buffer_size=8 * WIDTH * WIDTH, max_in_cpu=0)
        extra["aio"] = {"block_size": 65536, "queue_depth": 8, "intra_op_parallelism": 2}
    config = _config(3, zero={"offload_param": offload}, **extra)
    import ds_engine

    engine, *_ = ds_engine.initialize(model=_model(), config=copy.deepcopy(config), dist_init_required=False)
    shards = [p.ds_tensor for p in engine.module.parameters()]
    if where == "cpu":
        assert all(s.device.type == "cpu" and (DEVICE == "cpu" or s.is_pinned()) for s in shards)
    else:
        assert all(s.stride() == (0,) for s in shards)  # swapped out: the shard's storage is a stand-in
        assert any(p.is_file() for p in tmp_path.rglob("*"))
    del engine
    losses, weights, _ = _train_engine(config, steps=6)
    plain_losses, plain_weights, _ = _train_engine(_config(3), steps=6)
    torch.testing.assert_close(losses, plain_losses, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weights, plain_weights, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("stage", [0, 2])
def test_fp16_dynamic_loss_scale_skips_real_overflows_then_tracks_fp32(stage: int) -> None:
    import ds_engine

    fp16 = {"enabled": True, "loss_scale": 0, "initial_scale_power": 20, "hysteresis": 1, "loss_scale_window": 1000}
    model = _model()
    engine, *_ = ds_engine.initialize(model=model, config=_config(stage, fp16=fp16), dist_init_required=False)
    assert next(model.parameters()).dtype == torch.float16
    ref = _model().to(DEVICE)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.01, fused=True)
    tokens, scales, skipped = _tokens(20), [], 0
    for micro in range(20):
        idx = tokens[micro].to(DEVICE)
        before = _weights(engine)
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
        scales.append(engine.loss_scale())
        if not engine.was_step_applied():
            skipped += 1
            assert torch.equal(_weights(engine), before), f"step {micro} overflowed but changed the weights"
            continue
        ref(idx[:, :-1], idx[:, 1:]).backward()  # fp32 reference: only the batches the engine applied
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    assert skipped >= 1, "a scale of 2**20 should overflow fp16 gradients"
    assert scales[:skipped] == [2.0 ** (19 - k) for k in range(skipped)]  # halved on each overflow
    assert engine.skipped_steps == skipped and all(s == scales[skipped - 1] for s in scales[skipped:])
    ref_weights = torch.cat([p.detach().float().reshape(-1).cpu() for p in ref.parameters()])
    # fp16 rounding moves single weights by up to a few Adam steps (lr each): compare the whole vector.
    relative = ((_weights(engine) - ref_weights).norm() / ref_weights.norm()).item()
    assert relative < 3e-3, f"fp16 weights differ from fp32 by {relative:.2e} of their norm"


@pytest.mark.parametrize("stage", [0, 2])
def test_bf16_matches_a_plain_torch_emulation(stage: int) -> None:
    losses, weights, engine = _train_engine(_config(stage, bf16={"enabled": True}), steps=8)
    assert next(engine.module.parameters()).dtype == torch.bfloat16
    model = _model().to(DEVICE).to(torch.bfloat16)
    masters = [p.detach().float().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=3e-3, weight_decay=0.01, fused=True)
    tokens, ref_losses = _tokens(8), []
    for micro in range(8):
        idx = tokens[micro].to(DEVICE)
        loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        ref_losses.append(loss.item())
        for master, p in zip(masters, model.parameters(), strict=True):
            master.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for master, p in zip(masters, model.parameters(), strict=True):
                p.copy_(master)
    torch.testing.assert_close(losses, torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        weights, torch.cat([p.detach().float().reshape(-1).cpu() for p in model.parameters()]), rtol=1e-5, atol=1e-5
    )
