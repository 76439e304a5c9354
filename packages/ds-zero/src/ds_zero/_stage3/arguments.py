"""The two calling conventions of the stage-3 optimizers: (module, optimizer, config=...) as ds builds them,
and DeepSpeed's (optimizer, module=..., config=...)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["module_and_optimizer"]


def module_and_optimizer(
    args: tuple[Any, ...], module: nn.Module | None, optimizer: torch.optim.Optimizer | None
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """Sort the positional arguments of either calling convention into (module, optimizer).

    Raises:
        TypeError: an argument of another type, or the module or the optimizer missing (names which).
    """
    for arg in args:
        if isinstance(arg, nn.Module) and module is None:
            module = arg
        elif isinstance(arg, torch.optim.Optimizer) and optimizer is None:
            optimizer = arg
        else:
            raise TypeError(
                f"DeepSpeedZeroOptimizer_Stage3: unexpected positional argument of type "
                f"{type(arg).__name__}; pass (module, optimizer, config=...) or "
                "(optimizer, module=..., config=...)"
            )
    if module is None or optimizer is None:
        missing = "module (the model)" if module is None else "optimizer (a torch.optim.Optimizer)"
        raise TypeError(
            f"DeepSpeedZeroOptimizer_Stage3 needs a {missing}: pass (module, optimizer, config=...) "
            "or (optimizer, module=..., config=...)"
        )
    return module, optimizer
