"""A small test model for pipeline tests, its data, and a plain-PyTorch sequential reference.

The model passes a tuple `(hidden, mask)` between layers, where `mask` is an int64 tensor that
does not require grad, has a tied projection used at both ends (`TiedLayerSpec`), dropout, a
parameterless function layer, and a cross-entropy loss on int labels.
"""

from __future__ import annotations

import random
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ds_pipe import LayerSpec, TiedLayerSpec

D_IN, D, CLASSES, ROWS = 6, 8, 3, 4
BASE_SEED = 1234


class Embed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D_IN, D)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.lin(x)), (x[:, :1] > 0).to(torch.int64)


class Block(nn.Module):
    def __init__(self, p_drop: float = 0.0) -> None:
        super().__init__()
        self.lin, self.drop = nn.Linear(D, D), nn.Dropout(p_drop)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = inputs
        return h + self.drop(torch.tanh(self.lin(h))) * (1 + mask), mask


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(D, CLASSES)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.lin(inputs[0])


def tied_in(module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return module(inputs[0]), inputs[1]


def tied_out(module: nn.Module, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return F.linear(inputs[0], module.weight.t()), inputs[1]


def scale_half(inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return inputs[0] * 0.5, inputs[1]


def specs(p_drop: float = 0.0, num_blocks: int = 6) -> list[Any]:
    """Embed, tied-in, blocks (a function layer in the middle), tied-out, head."""
    blocks: list[Any] = [LayerSpec(Block, p_drop) for _ in range(num_blocks)]
    blocks.insert(num_blocks // 2, scale_half)
    return [
        LayerSpec(Embed),
        TiedLayerSpec("proj", nn.Linear, D, D, bias=False, forward_fn=tied_in),
        *blocks,
        TiedLayerSpec("proj", nn.Linear, D, D, bias=False, forward_fn=tied_out),
        LayerSpec(Head),
    ]


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels)


def micro_batch(step: int, replica: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-th micro-batch of data-parallel replica `replica` at training step `step`."""
    g = torch.Generator().manual_seed(10_000 * step + 100 * replica + k)
    return torch.randn(ROWS, D_IN, generator=g), torch.randint(0, CLASSES, (ROWS,), generator=g)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


class Reference(nn.Module):
    """The same layers run sequentially in one process, seeded exactly as `seed_layers=True` seeds them."""

    def __init__(self, layer_specs: list[Any]) -> None:
        super().__init__()
        self.layer_specs = layer_specs
        self.tied_modules = nn.ModuleDict()
        self.funcs: list[Any] = []
        for idx, spec in enumerate(layer_specs):
            seed_all(BASE_SEED + idx)
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in self.tied_modules:
                    self.tied_modules[spec.key] = spec.typename(*spec.module_args, **spec.module_kwargs)
                module = self.tied_modules[spec.key]
                self.funcs.append(lambda x, m=module, f=spec.forward_fn: f(m, x))
            elif isinstance(spec, LayerSpec):
                module = spec.typename(*spec.module_args, **spec.module_kwargs)
                self.add_module(str(idx), module)
                self.funcs.append(module)
            else:
                self.funcs.append(spec)
        self.forwards = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        for idx, func in enumerate(self.funcs):
            seed_all(BASE_SEED * self.forwards + idx)
            x = func(x)
        return x


def reference_run(
    layer_specs: list[Any], *, micro_batches: int, replicas: int, steps: int, lr: float
) -> dict[str, Any]:
    """Losses, first-step gradients and final parameters of the sequential model on the same data.

    Each replica's forward counter runs separately (as each data-parallel pipeline's does), so the
    reference keeps one forward count per replica.
    """
    model = Reference(layer_specs)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses, first_grads = [], {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for replica in range(replicas):
            model.forwards = step * micro_batches
            for k in range(micro_batches):
                x, y = micro_batch(step, replica, k)
                loss = loss_fn(model(x), y)
                (loss / (micro_batches * replicas)).backward()
                total += loss.detach()
        losses.append(total / (micro_batches * replicas))
        if step == 0:
            first_grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        opt.step()
    return {
        "losses": losses,
        "grads": first_grads,
        "params": {name: p.detach().clone() for name, p in model.named_parameters()},
    }
