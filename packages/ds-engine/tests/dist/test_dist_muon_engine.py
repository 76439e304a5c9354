"""`"optimizer": {"type": "Muon"}` through initialize() at ZeRO stages 0, 1 and 2 on 2 gloo ranks.

The reference is a plain single-process loop written here: the full global batch, the Muon step
spelled out (momentum, Nesterov blend, quintic Newton–Schulz, aspect-ratio scale, decoupled decay)
for the hidden matrices and torch's AdamW for the rest (embedding, head, biases, norm), which is
DeepSpeed's split. Weights must agree to 1e-6 after 5 steps (fp32).
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

TOL = 1e-6
STEPS = 5
VOCAB, DIM, HIDDEN = 20, 12, 28
LR, ADAM_LR, MOMENTUM, WD = 0.02, 3e-3, 0.9, 0.1
CONFIG_PARAMS = {"lr": LR, "adam_lr": ADAM_LR, "momentum": MOMENTUM, "weight_decay": WD, "betas": [0.9, 0.99]}
HAS_ZERO = importlib.util.find_spec("ds_zero") is not None


class SmallLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)  # 28x12: tall, scaled by sqrt(28/12)
        self.down = nn.Linear(HIDDEN, DIM)  # 12x28: wide
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(idx)
        h = self.norm(h + self.down(torch.tanh(self.up(h))))
        return nn.functional.cross_entropy(self.lm_head(h).reshape(-1, VOCAB), target.reshape(-1))


def _model() -> SmallLM:
    torch.manual_seed(0)
    return SmallLM()


def _data(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, VOCAB, (STEPS, world, 2, 6), generator=g)
    return idx, (idx * 7 + 1) % VOCAB


def _orthogonalize(m: torch.Tensor) -> torch.Tensor:
    x = m.t() if m.shape[0] > m.shape[1] else m
    x = x / (x.norm() + 1e-7)
    for _ in range(5):
        gram = x @ x.t()
        x = 3.4445 * x + (-4.7750 * gram + 2.0315 * gram @ gram) @ x
    return x.t() if m.shape[0] > m.shape[1] else x


def _reference(world: int) -> torch.Tensor:
    model = _model()
    matrices = [model.up.weight, model.down.weight]
    others = [p for p in model.parameters() if all(p is not m for m in matrices)]
    adam = torch.optim.AdamW(others, lr=ADAM_LR, betas=(0.9, 0.99), eps=1e-10, weight_decay=WD)
    bufs = [torch.zeros_like(m) for m in matrices]
    idx, target = _data(world)
    for step in range(STEPS):
        model.zero_grad()
        # the global batch: ranks' micro-batches of equal size, so the mean loss is the mean over all rows
        model(idx[step].reshape(-1, 6), target[step].reshape(-1, 6)).backward()
        with torch.no_grad():
            for m, buf in zip(matrices, bufs, strict=True):
                buf.mul_(MOMENTUM).add_(m.grad, alpha=1 - MOMENTUM)
                direction = m.grad * (1 - MOMENTUM) + buf * MOMENTUM
                update = _orthogonalize(direction) * math.sqrt(max(1.0, m.shape[0] / m.shape[1]))
                m.mul_(1 - LR * WD).sub_(LR * update)
        adam.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _train(rank: int, world: int, stage: int) -> dict[str, object]:
    import ds_engine as deepspeed

    model = _model()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "Muon", "params": CONFIG_PARAMS},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, "allgather_bucket_size": 100},
    }
    engine, optimizer, *_ = deepspeed.initialize(model=model, config=config)
    idx, target = _data(world)
    for step in range(STEPS):
        engine.backward(engine(idx[step, rank], target[step, rank]))
        engine.step()
    tags = {name: p.use_muon for name, p in model.named_parameters()}
    groups = [(g["name"], g["use_muon"], g["lr"]) for g in optimizer.param_groups]
    return {"weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()]), "tags": tags, "groups": groups}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_muon_config_matches_reference(stage: int) -> None:
    if stage and not HAS_ZERO:
        pytest.skip("ZeRO stages need ds-zero: pip install 'ds-engine[zero]'")
    results = run_ranks(2, _train, stage=stage, timeout_s=150)
    reference = _reference(2)
    initial = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    assert float((reference - initial).abs().max()) > 1e-2  # the steps really moved the weights
    for rank, r in enumerate(results):
        diff = float((r["weights"] - reference).abs().max())
        assert diff <= TOL, f"stage {stage} rank {rank}: weights differ from the reference by {diff}"
    tags = results[0]["tags"]
    assert {n for n, t in tags.items() if t} == {"up.weight", "down.weight"}  # not embed/lm_head/biases/norm
    assert results[0]["groups"] == [("muon-params", True, LR), ("adam-params", False, ADAM_LR)]
