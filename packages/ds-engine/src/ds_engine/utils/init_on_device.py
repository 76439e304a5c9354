"""`deepspeed.OnDevice` / `deepspeed.utils.OnDevice`: build a module directly on a device (often "meta") in a dtype.

DeepSpeed swaps out `torch.empty`/`zeros`/`ones`/`full` and `Tensor.__new__` for the block. torch now
has both halves natively: a `torch.device` is a context manager that sets the default device of every
factory call, and `torch.set_default_dtype` sets the dtype of floating-point tensors created without
one. `OnDevice` combines the two and restores both on exit, also after an exception.
"""

from __future__ import annotations

from types import TracebackType

import torch

__all__ = ["OnDevice"]


class OnDevice:
    """Within the block, tensors are created on `device`, and floating-point ones without a dtype in `dtype`.

        with OnDevice(dtype=torch.bfloat16, device="meta"):
            model = MyModel()   # parameters on "meta": shapes only, no memory

    Args:
        dtype: dtype of floating-point tensors created without an explicit one (None: unchanged).
        device: where tensors without an explicit device are created ("meta", "cpu", "cuda:0", ...).
        enabled: False makes the block a no-op.

    Raises:
        TypeError: `dtype` is not a floating-point dtype.
    """

    def __init__(self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True) -> None:
        if dtype is not None and not dtype.is_floating_point:
            raise TypeError(f"OnDevice(dtype=...) must be a floating-point dtype, got {dtype}")
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._saved_dtype: torch.dtype | None = None

    def __enter__(self) -> OnDevice:
        if self.enabled:
            self._saved_dtype = torch.get_default_dtype()
            if self.dtype is not None:
                torch.set_default_dtype(self.dtype)
            self.device.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.enabled:
            self.device.__exit__(exc_type, exc, tb)
            assert self._saved_dtype is not None
            torch.set_default_dtype(self._saved_dtype)
