"""`InsertPostInitMethodToModuleSubClasses`: DeepSpeed's base class of `zero.Init`, here the part that outlives it.

`ds_zero.Init` derives from it. What it owns is the one change `Init` makes to torch that DeepSpeed
keeps after the context exits: with `mem_efficient_linear`, `torch.nn.functional.linear` becomes
`zero3_linear_wrap` for the rest of the process, and the original is kept as the class attribute
`linear_bk` (set once, on first install). The stage-3 parameter manager (`DeepSpeedZeRoOffload`, which
the stage-3 optimizer builds) installs it the same way, as DeepSpeed's engine does through its own
`Init(module=...)`.
"""

from __future__ import annotations

from typing import Any, ClassVar

from ds_zero._stage3.linear import install_zero3_linear

__all__ = ["InsertPostInitMethodToModuleSubClasses"]


class InsertPostInitMethodToModuleSubClasses:
    """Base of `ds_zero.Init`: whether it is enabled and whether it installs the stage-3 linear.

    Args:
        enabled: False makes the context a no-op.
        mem_efficient_linear: replace `torch.nn.functional.linear` by `zero3_linear_wrap` (process-wide,
            persistent) when the context is entered or a module is partitioned.
    """

    linear_bk: ClassVar[Any]
    """The `torch.nn.functional.linear` found before the first install (absent until then)."""

    def __init__(self, enabled: bool = True, mem_efficient_linear: bool = True) -> None:
        self.enabled = enabled
        self.mem_efficient_linear = mem_efficient_linear

    def _enable_mem_efficient_linear(self) -> None:
        if self.enabled and self.mem_efficient_linear:
            install_zero3_linear(InsertPostInitMethodToModuleSubClasses)
