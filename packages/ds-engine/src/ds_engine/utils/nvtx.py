"""`deepspeed.utils.nvtx`: `instrument_w_nvtx`, a decorator that wraps each call in a profiler range.

The range carries the function's qualified name and goes through the accelerator's `range_push` /
`range_pop` (NVTX on CUDA, nothing on CPU), in the `"DeepSpeed"` domain where the accelerator
supports domains. Under `torch.compile` tracing no range is opened: it would break the graph. Setting
the module's `enable_nvtx` to False turns every decorated function back into a plain call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from torch.compiler import is_compiling

from ds_comm import get_accelerator

__all__ = ["DEEPSPEED_NVTX_DOMAIN", "enable_nvtx", "instrument_w_nvtx"]

enable_nvtx = True
DEEPSPEED_NVTX_DOMAIN = "DeepSpeed"

_F = TypeVar("_F", bound=Callable[..., Any])


def _push(accelerator: Any, message: str) -> None:
    if getattr(accelerator, "supports_nvtx_domain", False):
        accelerator.range_push(message, domain=DEEPSPEED_NVTX_DOMAIN)
    else:  # an accelerator whose range_push takes the message only
        accelerator.range_push(message)


def _pop(accelerator: Any) -> None:
    if getattr(accelerator, "supports_nvtx_domain", False):
        accelerator.range_pop(domain=DEEPSPEED_NVTX_DOMAIN)
    else:
        accelerator.range_pop()


def instrument_w_nvtx(func: _F) -> _F:
    """`func`, recording a profiler range named `func.__qualname__` around each call (closed on error too)."""

    @functools.wraps(func)
    def wrapped_fn(*args: Any, **kwargs: Any) -> Any:
        # Both switches are read per call: a profiler run may flip enable_nvtx after decoration.
        if not enable_nvtx or is_compiling():
            return func(*args, **kwargs)
        accelerator = get_accelerator()
        _push(accelerator, func.__qualname__)
        try:
            return func(*args, **kwargs)
        finally:
            _pop(accelerator)

    return wrapped_fn  # type: ignore[return-value]
