"""Tiny bf16-master training runs, written against DeepSpeed's API so that DeepSpeed 0.19.8 and ds run the same code.

`train(ds, rank, world, name)` takes the `deepspeed` module to use (`deepspeed` itself, or `ds_engine`), builds a
one-block transformer language model (seeded), trains it with `ds.initialize` under the config of run `name` for a
few steps on per-rank synthetic tokens, and returns this rank's per-step losses. `data/record_bf16_master_deepspeed.py`
runs every case under DeepSpeed and writes `data/bf16_master_deepspeed.json`; `dist/test_dist_bf16_master_offload.py`
runs them under ds and compares.

The runs: DeepSpeedExamples' `training/bf16_master_weight/configs/bf16_full.json` settings (ZeRO-3, bf16 masters,
gradients and Adam moments, `torch_autocast` bf16) and the same masters with the optimizer offloaded to the CPU at
ZeRO 1, 2 and 3, where the CPU Adam keeps the moments in bf16 (`bf16_optimizer_states`) or in fp32 (not set), and
to NVMe at ZeRO 3 (swap files under the temporary directory).
"""

from __future__ import annotations

import os
import tempfile
from types import ModuleType
from typing import Any

import torch
from torch import nn

VOCAB, HIDDEN, HEADS, SEQ, BATCH, STEPS = 64, 32, 4, 16, 2, 5


class TinyLM(nn.Module):
    """Token + position embeddings, one post-norm attention/MLP block, a vocabulary projection."""

    def __init__(self) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB, HIDDEN)
        self.positions = nn.Embedding(SEQ, HIDDEN)
        self.attn = nn.MultiheadAttention(HIDDEN, HEADS, batch_first=True)
        self.ln_attn = nn.LayerNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))
        self.ln_mlp = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        where = torch.arange(ids.shape[1], device=ids.device)
        x = self.tokens(ids) + self.positions(where)[None]
        x = self.ln_attn(x + self.attn(x, x, x, need_weights=False)[0])
        x = self.ln_mlp(x + self.mlp(x))
        return self.head(x)


def batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(500 + rank)
    return [torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def config(name: str, world: int) -> dict[str, Any]:
    """The ds_config of run `name` (see `RUNS`)."""
    stage, offload, states = RUNS[name]
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    zero["reduce_bucket_size"] = 5e7
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload == "nvme":
        swap = os.path.join(tempfile.gettempdir(), f"bf16_master_case_{name}")
        os.makedirs(swap, exist_ok=True)
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": swap}
    elif offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    bf16: dict[str, Any] = {"enabled": True, "bf16_master_weights_and_grads": True}
    if states:
        bf16["bf16_optimizer_states"] = True
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": BATCH * world,
        "steps_per_print": 1000,
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01},
        },
        "bf16": bf16,
        "zero_optimization": zero,
        "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"},
    }


def train(ds: ModuleType, rank: int, world: int, name: str) -> dict[str, Any]:
    """This rank's per-step losses under run `name`."""
    torch.manual_seed(1234)
    model = TinyLM()
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=config(name, world))
    losses = []
    for ids in batches(rank):
        logits = engine(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), ids[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    return {"losses": losses}


#: The runs recorded: name -> (ZeRO stage, optimizer offload: "" none, "cpu" or "nvme", bf16_optimizer_states).
#: Stages 1 and 2 first: a ZeRO-3 engine routes `F.linear` through its own autograd function for the rest of the
#: process (as DeepSpeed's does), which rounds differently from torch's addmm under autocast.
RUNS: dict[str, tuple[int, str, bool]] = {
    "offload_z1_bf16_states": (1, "cpu", True),
    "offload_z2_fp32_states": (2, "cpu", False),
    "bf16_full_z3": (3, "", True),
    "offload_z3_bf16_states": (3, "cpu", True),
    "offload_z3_fp32_states": (3, "cpu", False),
    "nvme_z3_bf16_states": (3, "nvme", True),
    "nvme_z3_fp32_states": (3, "nvme", False),
}
WORLD = 2
