"""`torch_patches_restored()`: undo, on exit, what stage 3 installs into torch for the rest of the process.

DeepSpeed's `memory_efficient_linear` makes `torch.nn.functional.linear` the stage-3 linear from the first
`zero.Init` or stage-3 engine on, and a quantized `Init` also wraps `F.embedding` and the state-dict loading
of `nn.Linear` / `nn.Embedding`; none of it is ever undone, as in DeepSpeed. Test suites (and a process that
builds a ZeRO-3 model and then needs torch's own functions back) snapshot those attributes with this
context manager, so one model's install does not leak into what runs next.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn
from torch.nn import functional

from ds_zero._construct.init_base import InsertPostInitMethodToModuleSubClasses

__all__ = ["torch_patches_restored"]

_LOADER_CLASSES = (nn.Linear, nn.Embedding)


@contextlib.contextmanager
def torch_patches_restored() -> Iterator[None]:
    """Run the body, then put back `F.linear`, `F.embedding`, the loaders and `linear_bk` as they were."""
    base = InsertPostInitMethodToModuleSubClasses
    saved = (functional.linear, functional.embedding)
    loaders = {cls: cls.__dict__.get("_load_from_state_dict") for cls in _LOADER_CLASSES}
    had_backup = "linear_bk" in base.__dict__
    try:
        yield
    finally:
        functional.linear, functional.embedding = saved
        for cls, loader in loaders.items():
            if loader is None:
                if "_load_from_state_dict" in cls.__dict__:
                    delattr(cls, "_load_from_state_dict")
            else:
                cls._load_from_state_dict = loader  # type: ignore[method-assign]
        if not had_backup and "linear_bk" in base.__dict__:
            del base.linear_bk
