"""One MoE training run under real DeepSpeed or under ds (`--engine`), for the side-by-side test.

Started by `torch.distributed.run` on gloo ranks. Every parameter's initial value is drawn from a generator
seeded by its GLOBAL name (an expert's index over all ranks), so both engines start from the same weights
whatever the expert-parallel layout; batches depend on (step, rank) only, and the global RNG is reseeded
before every forward so random token selection and Gumbel sampling draw the same numbers. Rank 0 writes
`<out>/moe.json`: per step and rank the loss, l_aux and every MoE layer's exp_counts.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any

import torch
from torch import nn

HIDDEN, VOCAB, SEQ, MICRO, EXPERTS, STEPS = 8, 16, 8, 2, 4, 6
CASES: dict[str, dict[str, Any]] = {
    "z0_ep2_k1": {"stage": 0, "ep": 2, "k": 1, "clip": 0.0, "rts": False},
    "z0_ep1_k2_rts": {"stage": 0, "ep": 1, "k": 2, "clip": 0.0, "rts": True},
    "z1_ep2_k2_clip": {"stage": 1, "ep": 2, "k": 2, "clip": 0.5, "rts": False},
    "z2_ep2_k1_rts_clip": {"stage": 2, "ep": 2, "k": 1, "clip": 0.5, "rts": True},
    "z2_ep1_k1_residual": {"stage": 2, "ep": 1, "k": 1, "clip": 0.0, "rts": False, "residual": True},
}
_EXPERT = re.compile(r"(deepspeed_experts\.)(\d+)(\.)")


class Model(nn.Module):
    def __init__(self, moe_cls: Any, case: dict[str, Any]) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mix = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.moe = nn.ModuleList(
            [
                moe_cls(
                    hidden_size=HIDDEN,
                    expert=nn.Sequential(nn.Linear(HIDDEN, 12), nn.ReLU(), nn.Linear(12, HIDDEN)),
                    num_experts=EXPERTS,
                    ep_size=case["ep"],
                    k=case["k"],
                    capacity_factor=1.0,
                    min_capacity=2,
                    use_rts=case["rts"],
                    use_residual=case.get("residual", False),
                    top2_2nd_expert_sampling=case["rts"],
                )
                for _ in range(2)
            ]
        )
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.record: dict[str, Any] = {}

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        aux = h.new_zeros(())
        counts = []
        for mix, moe in zip(self.mix, self.moe, strict=True):
            h = h + torch.tanh(mix(h))
            out, l_aux, exp_counts = moe(h)
            h = h + out
            aux = aux + l_aux
            counts.append([int(c) for c in exp_counts])
        self.record = {"l_aux": float(aux.detach()), "exp_counts": counts}
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)) + 0.01 * aux


def init_by_global_name(model: nn.Module, ep_rank: int, num_local: int) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            global_name = _EXPERT.sub(
                lambda m: f"{m.group(1)}{ep_rank * num_local + int(m.group(2))}{m.group(3)}", name, count=1
            )
            g = torch.Generator().manual_seed(zlib.crc32(global_name.encode()))
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * step + rank)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return ids, torch.roll(ids, 1, dims=1)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", required=True, choices=sorted(CASES))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--engine", choices=["deepspeed", "ds"], default="deepspeed")
    args = parser.parse_args()
    if args.engine == "deepspeed":
        import deepspeed as ds
    else:
        import ds_engine as ds
    from deepspeed.moe.layer import MoE  # ds: the `deepspeed` alias distribution maps it to ds-parallel's

    ds.init_distributed(dist_backend="gloo")
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    case = CASES[args.case]
    model = Model(MoE, case)
    init_by_global_name(model, rank % case["ep"], EXPERTS // case["ep"])
    config = {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": case["clip"],
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "weight_decay": 0.0, "torch_adam": True}},
        "zero_optimization": {"stage": case["stage"]},
    }
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    steps = []
    for step in range(STEPS):
        torch.manual_seed(100 * step + rank)
        loss = engine(*batch(rank, step))
        engine.backward(loss)
        engine.step()
        steps.append({"loss": float(loss.detach()), **model.record})
    gathered: list[Any] = [None] * world
    torch.distributed.all_gather_object(gathered, steps)
    if rank == 0:
        args.out.mkdir(parents=True, exist_ok=True)
        record = {"engine": args.engine, "version": ds.__version__, "case": args.case, "ranks": gathered}
        (args.out / "moe.json").write_text(json.dumps(record, indent=1) + "\n")
    torch.distributed.barrier()
    # Free the MoE layers' groups before the default one, while the interpreter is whole: a gloo group
    # freed during finalization aborts the process.
    del engine, model
    gc.collect()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    main()
