"""One tiny LoRA training run, written against DeepSpeed's API so that DeepSpeed 0.19.8 and ds run the same code.

`train(ds, rank, world, ...)` takes the `deepspeed` module to use (`deepspeed` itself, or `ds_engine`,
whose `linear` submodule is `deepspeed.linear`), builds a two-layer model of `OptimizedLinear` LoRA
layers (fp32, seeded), trains it with `ds.initialize` for a few steps on per-rank data, and returns the
per-step losses and the trained adapters' norms. `data/record_linear_lora_deepspeed.py` runs it under
DeepSpeed and writes `data/linear_lora_deepspeed.json`; `test_linear_deepspeed_reference.py` runs it
under ds and compares.

Two ways of getting base weights, both per DeepSpeed's semantics: "seeded" draws them in the layer
constructors (with sharding, each rank draws its own slice), "loaded" loads whole seeded weights through
`load_state_dict` (each rank keeps its slice of them).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch
from torch import nn

D_IN, D_HIDDEN, D_OUT, BATCH, STEPS, LR = 16, 32, 8, 4, 6, 0.02


class LoRANet(nn.Module):
    """x -> q_proj (LoRA) -> tanh -> down_proj (LoRA)."""

    def __init__(self, ds: ModuleType, sharding: int) -> None:
        super().__init__()
        config = ds.linear.LoRAConfig(lora_r=4, lora_alpha=8, base_weight_sharding=sharding)
        make = ds.linear.OptimizedLinear
        self.q_proj = make(D_IN, D_HIDDEN, lora_config=config, dtype=torch.float32)
        self.down_proj = make(D_HIDDEN, D_OUT, lora_config=config, dtype=torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(torch.tanh(self.q_proj(x)))


def _whole_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {
        "q_proj.weight": torch.randn(D_HIDDEN, D_IN, generator=g) * 0.3,
        "down_proj.weight": torch.randn(D_OUT, D_HIDDEN, generator=g) * 0.3,
    }


def build(ds: ModuleType, sharding: int, init: str) -> LoRANet:
    """The seeded model; with `init="loaded"` its base weights come from `_whole_weights()`."""
    torch.manual_seed(1234)
    model = LoRANet(ds, sharding)
    if init == "loaded":
        state = model.state_dict()
        state.update(_whole_weights())
        model.load_state_dict(state)
    return model


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(BATCH, D_IN, generator=g), torch.randn(BATCH, D_OUT, generator=g)) for _ in range(STEPS)]


def train(ds: ModuleType, rank: int, world: int, sharding: int, stage: int, init: str) -> dict[str, Any]:
    """Per-step losses (this rank's) and the trained adapters' norms."""
    model = build(ds, sharding, init)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "train_batch_size": BATCH * world,
        "optimizer": {"type": "Adam", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = ds.initialize(model=model, model_parameters=trainable, config=config)
    losses = []
    for x, y in batches(rank):
        loss = nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    norms = {
        name: float(p.detach().double().norm()) for name, p in engine.module.named_parameters() if "lora_weight" in name
    }
    base = {
        name: float(p.detach().double().norm()) for name, p in engine.module.named_parameters() if "lora" not in name
    }
    return {"losses": losses, "lora_norms": norms, "base_norms": base}


#: The runs recorded: name -> (world size, base_weight_sharding, ZeRO stage, init).
RUNS: dict[str, tuple[int, int, int, str]] = {
    "w1_seeded": (1, 1, 0, "seeded"),
    "w1_loaded": (1, 1, 0, "loaded"),
    "w2_shard2_zero1_seeded": (2, 2, 1, "seeded"),
    "w2_shard2_zero1_loaded": (2, 2, 1, "loaded"),
}
