"""The in-pass 16-bit copy, declared: optimizers whose step writes the updated values into 16-bit tensors too.

ZeRO-Offload keeps the fp32 master on the host and the model's 16-bit partition next to it; an
optimizer that writes both in one pass over memory saves a second pass (DeepSpeed's
`step(fp16_param_groups=...)`). Whether an optimizer can is a declared capability, a class attribute
`IN_PASS_COPY = True`, read with `supports_in_pass_copy`, so callers (ds-zero) never inspect a step's
signature. ds-ops' CPU optimizers declare it; any other optimizer may, by setting the attribute and
accepting the keyword.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

import torch

__all__ = ["InPassCopyOptimizer", "supports_in_pass_copy"]


class InPassCopyOptimizer(Protocol):
    """What `supports_in_pass_copy` promises about an optimizer."""

    IN_PASS_COPY: ClassVar[bool]

    def step(self, closure: Any = None, fp16_param_groups: Any = None) -> Any:
        """Update the parameters and write each result into its `fp16_param_groups` target in the same pass.

        `fp16_param_groups`: one list per param group with one tensor (or None) per parameter; each
        target is a contiguous tensor of the parameter's numel that receives the updated value
        rounded to its dtype.
        """
        ...


def supports_in_pass_copy(optimizer: torch.optim.Optimizer | Any) -> bool:
    """Whether `optimizer` declares the in-pass copy (`IN_PASS_COPY = True` on its class)."""
    return getattr(type(optimizer), "IN_PASS_COPY", False) is True
