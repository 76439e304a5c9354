"""A tiny MoE transformer block stack shared by the distributed MoE tests, and the copy of its weights from an
all-experts (ep_size=1) model into an expert-parallel one."""

from __future__ import annotations

import torch
from torch import nn

from ds_parallel.moe import MoE

HIDDEN, VOCAB, SEQ = 8, 16, 6


class TinyMoEModel(nn.Module):
    """Embedding -> (attention-free mixer + MoE) x 2 -> head; `forward(ids)` returns (logits, l_aux sum)."""

    def __init__(self, *, num_experts: int, ep_size: int, k: int, drop_tokens: bool = True, use_residual: bool = False):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.moe = nn.ModuleList(
            [
                MoE(
                    HIDDEN,
                    nn.Sequential(nn.Linear(HIDDEN, 12), nn.ReLU(), nn.Linear(12, HIDDEN)),
                    num_experts=num_experts,
                    ep_size=ep_size,
                    k=k,
                    capacity_factor=1.0,
                    min_capacity=2,
                    drop_tokens=drop_tokens,
                    use_rts=False,
                    use_residual=use_residual,
                    top2_2nd_expert_sampling=False,
                )
                for _ in range(2)
            ]
        )
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.embed(ids)
        l_aux = h.new_zeros(())
        for mix, moe in zip(self.mix, self.moe, strict=True):
            h = h + torch.tanh(mix(h))
            out, aux, _ = moe(h)
            h = h + out
            l_aux = l_aux + aux
        return self.head(h), l_aux


def expert_name(name: str, ep_rank: int, num_local: int) -> str:
    """The all-experts model's name of this rank's local expert parameter `name`."""
    parts = name.split(".")
    i = parts.index("deepspeed_experts") + 1
    parts[i] = str(ep_rank * num_local + int(parts[i]))
    return ".".join(parts)


def load_from_full(model: nn.Module, full: nn.Module, ep_rank: int, num_local: int) -> None:
    """Copy `full` (every expert) into `model` (this rank's experts only)."""
    source = dict(full.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            key = expert_name(name, ep_rank, num_local) if ".deepspeed_experts." in name else name
            p.copy_(source[key])


def batch(rank: int, step: int, batch_size: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    ids = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def loss_of(model: nn.Module, ids: torch.Tensor, labels: torch.Tensor, aux_weight: float = 0.01) -> torch.Tensor:
    logits, l_aux = model(ids)
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + aux_weight * l_aux
