"""Each test starts with torch's own `F.linear` / `F.embedding` and leaves them so.

`ds_zero.Init` and the stage-3 parameter manager replace `torch.nn.functional.linear` for the rest of the
process (DeepSpeed's `memory_efficient_linear`), and a quantized `Init` also wraps `F.embedding` and the
state-dict loading of `nn.Linear` / `nn.Embedding`; what one test installs must not change what the next
one runs.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from torch import nn
from torch.nn import functional


@pytest.fixture(autouse=True)
def _restore_torch_linear() -> Iterator[None]:
    from ds_zero import InsertPostInitMethodToModuleSubClasses as Base

    saved = (functional.linear, functional.embedding)
    loaders = {cls: cls.__dict__.get("_load_from_state_dict") for cls in (nn.Linear, nn.Embedding)}
    had_backup = "linear_bk" in Base.__dict__
    yield
    functional.linear, functional.embedding = saved
    for cls, loader in loaders.items():
        if loader is None:
            if "_load_from_state_dict" in cls.__dict__:
                delattr(cls, "_load_from_state_dict")
        else:
            cls._load_from_state_dict = loader  # type: ignore[method-assign]
    if not had_backup and "linear_bk" in Base.__dict__:
        del Base.linear_bk
