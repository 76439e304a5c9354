"""`deepspeed.utils.torch`: checks of the installed torch, and the gradient hook that depends on it.

`required_torch_version(min_version=2.1)` is what DeepSpeed code and tests use to gate features.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.torch_version import TorchVersion

__all__ = ["register_grad_hook", "required_torch_version"]


def required_torch_version(min_version: float | str | None = None, max_version: float | str | None = None) -> bool:
    """Whether the installed torch is at least `min_version` and at most `max_version` (either may be omitted).

    Versions compare as release numbers (`2.13` is newer than `2.4`); a local tag such as `+cpu` is ignored.

    Raises:
        ValueError: neither bound is given.
    """
    if min_version is None and max_version is None:
        raise ValueError("required_torch_version: give a min_version or a max_version")
    installed = TorchVersion(torch.__version__.split("+")[0])
    if min_version is not None and installed < TorchVersion(str(min_version)):
        return False
    return max_version is None or installed <= TorchVersion(str(max_version))


def register_grad_hook(param: torch.Tensor, hook: Callable[[torch.Tensor], Any]) -> Any:
    """Call `hook(param)` each time a gradient has been accumulated into `param.grad`; returns the handle."""
    return param.register_post_accumulate_grad_hook(hook)
