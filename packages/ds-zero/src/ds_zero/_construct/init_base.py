"""`InsertPostInitMethodToModuleSubClasses`: DeepSpeed's base class of `zero.Init`, here the part that outlives it.

`ds_zero.Init` derives from it, so code that checks `isinstance(x, InsertPostInitMethodToModuleSubClasses)`
or reads `enabled` / `mem_efficient_linear` / `linear_bk` works unchanged. What it owns is the change to
torch that DeepSpeed keeps after the context exits: with `mem_efficient_linear`,
`torch.nn.functional.linear` becomes `zero3_linear_wrap` for the rest of the process, the original kept
once as the class attribute `linear_bk`. It is installed when an enabled `Init` is entered or given
`module=`, and by the stage-3 parameter manager (`DeepSpeedZeRoOffload`) when it partitions a model, as
DeepSpeed's engine does through its own `Init(module=...)`; constructing an `Init` installs nothing.
With `weight_quantization.quantized_initialization`, entering also wraps `F.linear` / `F.embedding` (and
`nn.Linear` / `nn.Embedding` state-dict loading) so quantized weights are dequantized where they are
used (`_construct.quantized_init`).

Why ds installs it although it does not need it: ds-zero's saved-tensor hooks (`_schedule.saved_tensors`)
already re-gather every saved view of a partitioned weight for backward, whatever the op; but code
written for DeepSpeed observes the patch (`F.linear is zero3_linear_wrap`, `linear_bk`, the `grad_fn`
type of a linear's output), so ds gives DeepSpeed's behaviour. What it costs: every `F.linear` in the
process, ZeRO or not, goes through `zero3_linear_wrap`. Where autograd records nothing (no grad, or
no input requires grad) that is one check before torch's kernel; where it records, a Python autograd
function (see `_construct.linear` for the measured overhead: a few microseconds per call, visible only on
small layers). `memory_efficient_linear: false` leaves `F.linear` alone and sets no `linear_bk`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ds_zero._construct.linear import install_zero3_linear

__all__ = ["InsertPostInitMethodToModuleSubClasses"]


class InsertPostInitMethodToModuleSubClasses:
    """Base of `ds_zero.Init`: whether it is enabled and whether it installs the stage-3 linear.

    Args:
        enabled: False makes the context a no-op (and installs nothing).
        mem_efficient_linear: make `torch.nn.functional.linear` `zero3_linear_wrap` (process-wide, for the
            rest of the process) when the context is entered or a module is partitioned.
    """

    linear_bk: ClassVar[Any]
    """The `torch.nn.functional.linear` found before the first install (absent until then)."""

    def __init__(self, enabled: bool = True, mem_efficient_linear: bool = True) -> None:
        self.enabled = enabled
        self.mem_efficient_linear = mem_efficient_linear

    def _enable_mem_efficient_linear(self) -> None:
        """DeepSpeed's install: `F.linear` becomes `zero3_linear_wrap` unless something else replaced it."""
        if self.enabled and self.mem_efficient_linear:
            install_zero3_linear(InsertPostInitMethodToModuleSubClasses)
