"""A tiny MoE transformer for the engine's MoE tests, and its all-experts reference trained on one rank."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

HIDDEN, VOCAB, SEQ, MICRO = 8, 16, 6, 2
NUM_EXPERTS = 4
_EXPERT = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")


class TinyMoE(nn.Module):
    """Embedding -> 2 x (mixer + MoE) -> head; returns the loss (cross entropy + 0.01 * l_aux)."""

    def __init__(self, ep_size: int, k: int = 2, use_residual: bool = False) -> None:
        super().__init__()
        from ds_parallel.moe import MoE

        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.moe = nn.ModuleList(
            [
                MoE(
                    HIDDEN,
                    nn.Sequential(nn.Linear(HIDDEN, 12), nn.ReLU(), nn.Linear(12, HIDDEN)),
                    num_experts=NUM_EXPERTS,
                    ep_size=ep_size,
                    k=k,
                    min_capacity=2,
                    use_rts=False,
                    use_residual=use_residual,
                    top2_2nd_expert_sampling=False,
                )
                for _ in range(2)
            ]
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        aux = h.new_zeros(())
        for mix, moe in zip(self.mix, self.moe, strict=True):
            h = h + torch.tanh(mix(h))
            out, l_aux, _ = moe(h)
            h = h + out
            aux = aux + l_aux
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + 0.01 * aux


def global_name(name: str, ep_rank: int, num_local: int) -> str:
    return _EXPERT.sub(lambda m: f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}", name, count=1)


def load_full_into(model: nn.Module, full: nn.Module, ep_rank: int, num_local: int) -> None:
    src = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(src[global_name(name, ep_rank, num_local)])


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def reference_run(world: int, steps: int, lr: float, clip: float) -> tuple[nn.Module, list[list[float]]]:
    """All experts on one rank, every rank's batch per step, the gradient of the mean loss, AdamW."""
    torch.manual_seed(0)
    full = TinyMoE(ep_size=1)
    opt = torch.optim.AdamW(full.parameters(), lr=lr, weight_decay=0.0)
    losses: list[list[float]] = []
    for step in range(steps):
        opt.zero_grad()
        per_rank = [full(*batch(r, step)) for r in range(world)]
        losses.append([float(v.detach()) for v in per_rank])
        (sum(per_rank) / world).backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(full.parameters(), clip)
        opt.step()
    return full, losses


def config(stage: int, clip: float, lr: float) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 200, "allgather_bucket_size": 300},
    }
