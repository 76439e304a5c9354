"""`"optimizer": {"type": "Muon"}` through initialize() at ZeRO stage 3 on 2 gloo ranks, with `per_head_muon`.

The model is a small grouped-query attention block with a Hugging Face style `config` (4 query heads,
2 key/value heads of width 3): with `per_head_muon` q_proj is orthogonalized as 4 blocks of 3 rows and
k_proj as 2, o_proj and the MLP whole. v_proj is frozen (partial training). The reference is a plain
single-process loop written here (Muon spelled out per head / per matrix, torch AdamW for the rest) on
the global batch; weights must agree to 1e-5 after 4 steps (fp32). Also: a checkpoint saved after 2
steps and loaded into a fresh engine continues exactly as the straight run (the partitioned Muon
momentum travels), and the DeepSpeed partial-training case where every Muon matrix is frozen.
"""

from __future__ import annotations

import importlib.util
import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ds_zero") is None, reason="needs ds-zero")

TOL = 1e-5
STEPS = 4
VOCAB, HID, HEADS, KV, HD = 16, 12, 4, 2, 3
LR, ADAM_LR, MOMENTUM, WD = 0.02, 3e-3, 0.9, 0.1
PARAMS = {"lr": LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD, "betas": [0.9, 0.99]}


class Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=HEADS, num_key_value_heads=KV, head_dim=HD, hidden_size=HID)
        self.embed_tokens = nn.Embedding(VOCAB, HID)
        self.q_proj = nn.Linear(HID, HEADS * HD, bias=False)
        self.k_proj = nn.Linear(HID, KV * HD, bias=False)
        self.v_proj = nn.Linear(HID, KV * HD, bias=False)
        self.o_proj = nn.Linear(HEADS * HD, HID, bias=False)
        self.up = nn.Linear(HID, 20)
        self.lm_head = nn.Linear(HID, VOCAB, bias=False)
        self.v_proj.weight.requires_grad_(False)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(idx)  # [b, t, HID]
        b, t, _ = h.shape
        q = self.q_proj(h).view(b, t, HEADS, HD).transpose(1, 2)
        k = self.k_proj(h).view(b, t, KV, HD).transpose(1, 2).repeat_interleave(HEADS // KV, 1)
        v = self.v_proj(h).view(b, t, KV, HD).transpose(1, 2).repeat_interleave(HEADS // KV, 1)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(HD), -1) @ v
        h = h + self.o_proj(a.transpose(1, 2).reshape(b, t, HEADS * HD))
        h = h + torch.tanh(self.up(h)).sum(-1, keepdim=True)
        return nn.functional.cross_entropy(self.lm_head(h).reshape(-1, VOCAB), target.reshape(-1))


def _model() -> Attn:
    torch.manual_seed(0)
    return Attn()


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    idx = torch.randint(0, VOCAB, (STEPS, 2, 2, 5), generator=g)  # step, rank, micro-batch rows, seq
    return idx, (idx * 3 + 1) % VOCAB


def _orthogonalize(m: torch.Tensor) -> torch.Tensor:
    tall = m.shape[0] > m.shape[1]
    x = m.t() if tall else m
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        gram = x @ x.t()
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x.t() * math.sqrt(m.shape[0] / m.shape[1]) if tall else x


def _reference() -> torch.Tensor:
    model = _model()
    heads = {model.q_proj.weight: HEADS, model.k_proj.weight: KV, model.o_proj.weight: 1, model.up.weight: 1}
    matrices = list(heads)
    others = [p for p in model.parameters() if p.requires_grad and all(p is not m for m in matrices)]
    adam = torch.optim.AdamW(others, lr=ADAM_LR, betas=(0.9, 0.99), eps=1e-10, weight_decay=WD)
    bufs = [torch.zeros_like(m) for m in matrices]
    idx, target = _data()
    for step in range(STEPS):
        model.zero_grad()
        model(idx[step].reshape(-1, 5), target[step].reshape(-1, 5)).backward()
        with torch.no_grad():
            for m, buf in zip(matrices, bufs, strict=True):
                buf.lerp_(m.grad, 1 - MOMENTUM)
                d = m.grad.lerp(buf, MOMENTUM)
                update = torch.cat([_orthogonalize(block) for block in d.split(d.shape[0] // heads[m])])
                m.mul_(1 - LR * WD).sub_(LR * update)
        adam.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _engine(**extra: Any) -> tuple[Any, Attn]:
    import ds_engine as deepspeed

    model = _model()
    for name in extra.pop("freeze", ()):
        model.get_parameter(name).requires_grad_(False)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Muon", "params": {**PARAMS, "per_head_muon": True}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": 200,
            "sub_group_size": 100,
            "save_muon_momentum_buffer_in_memory": True,
        },
    }
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine, model


def _steps(engine: Any, rank: int, steps: range) -> None:
    idx, target = _data()
    for step in steps:
        engine.backward(engine(idx[step, rank], target[step, rank]))
        engine.step()


def _weights(model: nn.Module) -> torch.Tensor:
    import ds_zero

    sd = ds_zero.consolidated_16bit_state_dict(model, rank0_only=False)
    return torch.cat([sd[n].float().reshape(-1) for n, _ in model.named_parameters()])


def _run(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    engine, model = _engine()
    _steps(engine, rank, range(STEPS))
    out: dict[str, Any] = {"straight": _weights(model)}
    out["heads"] = {n: p.muon_num_heads for n, p in model.named_parameters() if p.muon_num_heads}
    engine, model = _engine()
    _steps(engine, rank, range(2))
    engine.save_checkpoint(ckpt, tag="two")
    engine, model = _engine()
    engine.load_checkpoint(ckpt, tag="two")
    _steps(engine, rank, range(2, STEPS))
    out["resumed"] = _weights(model)
    # every Muon matrix frozen: only the Adam group is left, and it trains
    engine, model = _engine(freeze=("q_proj.weight", "k_proj.weight", "o_proj.weight", "up.weight"))
    before = _weights(model)
    _steps(engine, rank, range(1))
    out["adam_only_moved"] = float((_weights(model) - before).abs().max())
    out["adam_only_groups"] = [g["use_muon"] for g in engine.optimizer.param_groups]
    return out


def test_muon_zero3_engine_per_head_checkpoint_and_frozen(tmp_path) -> None:
    results = run_ranks(2, _run, ckpt=str(tmp_path), timeout_s=240)
    reference = _reference()
    assert float((reference - torch.cat([p.detach().reshape(-1) for p in _model().parameters()])).abs().max()) > 1e-2
    for rank, r in enumerate(results):
        diff = float((r["straight"] - reference).abs().max())
        assert diff <= TOL, f"rank {rank}: ZeRO-3 Muon weights differ from the per-head reference by {diff}"
        assert r["heads"] == {"q_proj.weight": HEADS, "k_proj.weight": KV, "v_proj.weight": KV}, r["heads"]
        assert float((r["resumed"] - r["straight"]).abs().max()) == 0.0, f"rank {rank}: resumed run differs"
        assert r["adam_only_moved"] > 0 and r["adam_only_groups"] == [False], r
