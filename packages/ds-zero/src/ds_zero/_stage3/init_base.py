"""`InsertPostInitMethodToModuleSubClasses`: DeepSpeed's name for the base class of `zero.Init`.

`ds_zero.Init` derives from it, so code that checks `isinstance(x, InsertPostInitMethodToModuleSubClasses)`
or reads its `enabled` / `mem_efficient_linear` attributes works unchanged.

What DeepSpeed hangs on this class, ds deliberately does not do: with `mem_efficient_linear` DeepSpeed
replaces `torch.nn.functional.linear` by its `zero3_linear_wrap` for the rest of the process (keeping the
original as `linear_bk`), so that backward re-gathers a weight released after forward. ds-zero gets that
memory saving for every op, not only linear, from its saved-tensor hooks (`_stage3.saved_tensors`), so a
process-wide patch would only cost: every `F.linear` in the process, ZeRO or not, would run through a
Python autograd function (forward+backward of an 8x64 by 64x64 linear on a 2-core CPU: 107 us against
torch's 46 us; at 256x1024 by 1024x1024, 1.03x). `zero3_linear_wrap` is in `deepspeed.runtime.zero.linear`
(ds-engine) for code that calls it; `F.linear` stays torch's.
"""

from __future__ import annotations

__all__ = ["InsertPostInitMethodToModuleSubClasses"]


class InsertPostInitMethodToModuleSubClasses:
    """Base of `ds_zero.Init`: whether it is enabled, and DeepSpeed's linear flag (recorded, see the module).

    Args:
        enabled: False makes the context a no-op.
        mem_efficient_linear: DeepSpeed's switch for its process-wide linear patch; ds records it and keeps
            `torch.nn.functional.linear` as it is (stage 3 re-gathers saved weights whatever the op).
    """

    def __init__(self, enabled: bool = True, mem_efficient_linear: bool = True) -> None:
        self.enabled = enabled
        self.mem_efficient_linear = mem_efficient_linear
