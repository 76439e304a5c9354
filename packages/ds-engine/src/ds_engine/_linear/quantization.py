"""`QuantizedParameter` (a frozen weight kept as packed small floats) and `QuantizedLinear` (a linear layer on one).

The parameter quantizes itself whenever its data sits on the accelerator's device (at construction, and
after `.to(device)`), as DeepSpeed's does; ds's quantizer is plain PyTorch (`FPQuantizer`), so on a CPU
accelerator the weight is quantized on the host at construction and the layer computes with it there.
`dequantized()` gives the weight back in its own shape and dtype for the forward.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ds_comm import get_accelerator
from ds_engine._linear.config import QuantizationConfig, check_quantization_config
from ds_engine._linear.fp_quantizer import FPQuantizer

logger = logging.getLogger(__name__)

__all__ = ["QuantizedLinear", "QuantizedParameter"]


class QuantizedParameter(nn.Parameter):
    """A frozen parameter stored quantized; `dequantized()` is the weight to compute with.

    Args:
        data: the weight (floating point), or already packed bytes (a clone's data).
        requires_grad: must be False: a quantized weight is not trained.
        quantization_config: the format (`QuantizationConfig()` when None).
        quantizer: the object that quantizes and dequantizes (an `FPQuantizer` when None). It lives on
            the parameter because frameworks clone parameters as `type(p)(p.data, **p.__dict__)`, and the
            quantizer knows the shape the bytes stand for.
    """

    quantization_config: QuantizationConfig
    quantizer: Any

    def __new__(
        cls,
        data: torch.Tensor | None = None,
        requires_grad: bool = False,
        quantization_config: QuantizationConfig | None = None,
        quantizer: Any = None,
    ) -> QuantizedParameter:
        if requires_grad:
            raise ValueError("requires_grad=True is not supported with QuantizedParameter (it is a frozen weight)")
        if data is None:
            data = torch.empty(0)
        self = torch.Tensor._make_subclass(cls, data, requires_grad)
        config = QuantizationConfig() if quantization_config is None else quantization_config
        self.quantization_config = check_quantization_config(config, "QuantizedParameter.quantization_config")
        self.quantizer = FPQuantizer(self.quantization_config) if quantizer is None else quantizer
        self._ensure_quantized(self)
        return self

    def _ensure_quantized(self, tensor: torch.Tensor) -> None:
        """Quantize `tensor` in place when it is on the accelerator's device and not quantized yet."""
        if get_accelerator().on_accelerator(tensor) and tensor.dtype != self.quantization_config.q_dtype:
            tensor.data = self.quantizer.quantize(
                tensor.data,
                q_bits=self.quantization_config.q_bits,
                q_mantisa_bits=self.quantization_config.mantissa_bits,
            )

    def dequantized(self) -> torch.Tensor:
        """The weight in its own shape and dtype (the data itself while it is not quantized)."""
        if self.data.dtype == self.quantization_config.q_dtype:
            return self.quantizer.dequantize(
                self.data,
                q_bits=self.quantization_config.q_bits,
                q_mantisa_bits=self.quantization_config.mantissa_bits,
            )
        return self.data

    def offload(self, revert: bool = False) -> None:
        """Move the packed bytes to the host (or back, `revert=True`) when the engine marked it `ds_offload`."""
        if getattr(self, "ds_offload", False):
            self.data = self.data.to(get_accelerator().current_device_name() if revert else "cpu")

    def __deepcopy__(self, memo: dict[int, Any]) -> QuantizedParameter:
        data = copy.deepcopy(self.data, memo)
        clone = QuantizedParameter(
            data,
            quantization_config=copy.deepcopy(self.quantization_config, memo),
            quantizer=copy.deepcopy(self.quantizer, memo),
        )
        for key, value in self.__dict__.items():
            if key not in ("quantization_config", "quantizer"):
                setattr(clone, key, copy.deepcopy(value, memo))
        memo[id(self)] = clone
        return clone

    def __reduce_ex__(self, protocol: Any) -> Any:
        extra = {k: v for k, v in self.__dict__.items() if k not in ("quantization_config", "quantizer")}
        return (_rebuild, (self.data, self.quantization_config, self.quantizer, extra))

    def cuda(self, device: Any = None, non_blocking: bool = False) -> torch.Tensor:  # type: ignore[override]
        return self.to("cuda" if device is None else device, non_blocking=non_blocking)

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Move (or cast) like a tensor; the result is quantized when it lands on the accelerator's device.

        Module moves (`model.to(device)`) call this and keep the result as the parameter's data.
        """
        tensor = super().to(*args, **kwargs)
        self.quantizer.to(*args, **kwargs)
        self._ensure_quantized(tensor)
        return tensor


def _rebuild(
    data: torch.Tensor, config: QuantizationConfig, quantizer: Any, extra: dict[str, Any]
) -> QuantizedParameter:
    param = QuantizedParameter(data, quantization_config=config, quantizer=quantizer)
    param.__dict__.update(extra)
    return param


class QuantizedLinear(nn.Linear):
    """`nn.Linear` whose weight is a `QuantizedParameter`, dequantized at each forward (the bias stays as is).

    Args:
        input_dim: in features.
        output_dim: out features.
        bias: add a (trainable, unquantized) bias.
        quantization_config: the weight's format.
        dtype: the weight's dtype before quantization and after dequantization (bf16 by default).
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        bias: bool = False,
        quantization_config: QuantizationConfig | None = None,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        if not dtype.is_floating_point:
            raise ValueError(f"QuantizedLinear: dtype must be a floating-point dtype, got {dtype}")
        super().__init__(input_dim, output_dim, bias=bias, dtype=dtype)
        self.weight = QuantizedParameter(self.weight.data, quantization_config=quantization_config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        weight = cast(QuantizedParameter, self.weight).dequantized()  # set so in __init__
        if weight.dtype != input.dtype and input.is_floating_point():
            weight = weight.to(input.dtype)  # the packed weight does not follow module casts (it is not floating point)
        return F.linear(input, weight, self.bias)
