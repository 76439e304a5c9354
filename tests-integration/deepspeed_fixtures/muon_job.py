"""`"optimizer": {"type": "Muon"}` for 4 steps at 2 gloo ranks, under ds or under the real DeepSpeed.

    python -m torch.distributed.run --nproc_per_node=2 muon_job.py --engine ds|deepspeed --stage S --out DIR

Rank 0 writes `DIR/muon.json`: the optimizer's param groups (name, use_muon, lr, weight_decay), each
parameter's `use_muon` tag, the losses, and the final (at stage 3 gathered) weights. Two param groups come
in (no weight decay on biases) so the Muon/Adam split has to keep them apart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

VOCAB, DIM, HIDDEN = 20, 12, 28


class SmallLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(idx)
        h = self.norm(h + self.down(torch.tanh(self.up(h))))
        return nn.functional.cross_entropy(self.lm_head(h).reshape(-1, VOCAB), target.reshape(-1))


class PerHeadLM(SmallLM):
    """SmallLM with query/key projections and a Hugging Face style config (3 heads of 4), for `per_head_muon`."""

    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(num_attention_heads=3, num_key_value_heads=3, hidden_size=DIM)
        self.q_proj = nn.Linear(DIM, DIM, bias=False)
        self.k_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(idx)
        q, k = self.q_proj(h).view(*h.shape[:-1], 3, 4), self.k_proj(h).view(*h.shape[:-1], 3, 4)
        h = h + torch.tanh((q * k).sum(-1)).repeat_interleave(4, -1)
        h = self.norm(h + self.down(torch.tanh(self.up(h))))
        return nn.functional.cross_entropy(self.lm_head(h).reshape(-1, VOCAB), target.reshape(-1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine", choices=("ds", "deepspeed"), required=True)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--per-head", action="store_true", help="PerHeadLM with optimizer.params.per_head_muon")
    args = parser.parse_args()
    if args.engine == "deepspeed":
        import deepspeed
    else:
        import ds_engine as deepspeed
    torch.manual_seed(0)
    model = PerHeadLM() if args.per_head else SmallLM()
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": 0.1},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0},
    ]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {
            "type": "Muon",
            "params": {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "betas": [0.9, 0.99]}
            | ({"per_head_muon": True} if args.per_head else {}),
        },
        # DeepSpeed 0.19.8 refuses Muon with reduce_scatter at stage 3 (ds accepts either)
        "zero_optimization": {"stage": args.stage, **({"reduce_scatter": False} if args.stage == 3 else {})},
    }
    engine, optimizer, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    data = torch.randint(0, VOCAB, (4, world, 2, 6), generator=torch.Generator().manual_seed(3))
    losses = []
    for step in range(4):
        idx = data[step, rank]
        loss = engine(idx, (idx * 7 + 1) % VOCAB)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    base = getattr(optimizer, "optimizer", optimizer)
    with deepspeed.zero.GatheredParameters(list(model.parameters()), enabled=args.stage == 3):
        weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).tolist()
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        result = {
            "groups": [[g["name"], g["use_muon"], g["lr"], g["weight_decay"]] for g in base.param_groups],
            "tags": {n: bool(p.use_muon) for n, p in model.named_parameters()},
            "heads": {n: getattr(p, "muon_num_heads", None) for n, p in model.named_parameters()},
            "losses": losses,
            "weights": weights,
        }
        (args.out / "muon.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
