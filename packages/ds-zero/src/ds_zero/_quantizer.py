"""ds-zero's group-wise quantizers: ZeRO++'s all-gather quantizer and ZeRO-Inference's weight quantizer.

`CUDAQuantizer`: DeepSpeed's ZeRO++ weight quantizer (symmetric int8 in groups), with a PyTorch kernel.

DeepSpeed's class calls a compiled kernel module (`QuantizerBuilder().load()`, fp16 in, fp16 out) held
in the class attribute `quantizer_cuda_module`, which code and tests replace. ds keeps that contract: the
attribute is any object with DeepSpeed's kernel methods, `quantize(x, groups, num_bits, quant_type)`
-> (int8 values, fp32 scales) and `dequantize(q, scales, groups, num_bits, quant_type)` -> fp16, and
`Symmetric`. Left unset, it is `TorchQuantizerModule`, the same arithmetic in plain PyTorch on any device.
As in DeepSpeed, `quantize` hands the kernel fp16 (a bf16 or fp32 tensor is converted first) and
`dequantize(..., dtype=)` returns the caller's dtype.

`GroupQuantizer`: the weight quantizer of `weight_quantization.quantized_initialization` (DeepSpeed's
`Quantizer` / `DeQuantizer` pair): 8 or 4 bits per value in groups of `group_size` consecutive values
along dimension `group_dim`, each group with its own minimum and step (unsigned codes, `round((x - min)
/ step)`, two 4-bit codes packed per byte along the last dimension), so each value comes back within
half its group's step `(max - min) / (2**num_bits - 1)`. `symmetric` centres each group's range on zero
(`min = -max|x|`), which DeepSpeed refuses and ds allows.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

import ds_comm

__all__ = ["CUDAQuantizer", "GroupQuantizer", "TorchQuantizerModule"]


class TorchQuantizerModule:
    """Symmetric group-wise quantization in PyTorch, with the kernel module's signatures.

    Each of `groups` equal, contiguous groups of the flattened input gets one fp32 scale, its largest
    magnitude over `2**(num_bits-1) - 1`; values are rounded to the nearest multiple of it (so the error
    of each value is at most half its group's scale) and clamped to the signed range.
    """

    Symmetric = 0
    Asymmetric = 1

    def quantize(
        self, x: torch.Tensor, groups: int, num_bits: int, quant_type: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 values shaped like `x`, fp32 scales of shape (groups,))."""
        self._check(num_bits, quant_type)
        q_max = 2 ** (num_bits - 1) - 1
        rows = x.reshape(groups, -1).float()
        scales = rows.abs().amax(dim=1) / q_max
        safe = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero group stays zero
        q = torch.round(rows / safe[:, None]).clamp_(-q_max, q_max).to(torch.int8)
        return q.reshape(x.shape), scales

    def dequantize(
        self, q: torch.Tensor, scales: torch.Tensor, groups: int, num_bits: int, quant_type: int
    ) -> torch.Tensor:
        """fp16 values, flat, from int8 `q` and its `groups` scales."""
        self._check(num_bits, quant_type)
        rows = q.reshape(groups, -1).float() * scales.reshape(groups, 1).float()
        return rows.reshape(-1).to(torch.half)

    def _check(self, num_bits: int, quant_type: int) -> None:
        if quant_type != self.Symmetric or not 2 <= num_bits <= 8:
            raise ValueError(
                f"TorchQuantizerModule supports symmetric quantization to 2..8 bits, got num_bits={num_bits}, "
                f"quant_type={quant_type}"
            )


def _num_groups(numel: int, target_group_size: int) -> int:
    """DeepSpeed's adaptive group count: the fewest groups of at most ~`target_group_size` that split
    `numel` into multiples of 8, doubled while the groups stay that large and the split stays exact."""
    groups = max(1, math.ceil(numel / target_group_size))
    while groups < numel and numel % (8 * groups):
        groups += 1
    while numel % (16 * groups) == 0 and numel / groups > target_group_size:
        groups *= 2
    if numel % (8 * groups) or numel <= groups or numel / groups >= 16000:
        raise ValueError(
            f"quantized weights need a tensor that splits into groups of a multiple of 8 elements (under 16000 "
            f"each); {numel} elements do not"
        )
    return groups


class CUDAQuantizer:
    """Quantize a flat tensor to int8 in groups for the ZeRO++ quantized all-gather, and back.

    The group count for a size is chosen once (`target_group_size` elements per group at most, in
    multiples of 8) and cached on the class.
    """

    async_flag: ClassVar[bool] = True
    target_group_size: ClassVar[int] = 8000
    group_size_cache: ClassVar[dict[int, int]] = {}
    quantizer_cuda_module: ClassVar[Any] = None

    def __init__(self) -> None:
        if CUDAQuantizer.quantizer_cuda_module is None:
            CUDAQuantizer.quantizer_cuda_module = TorchQuantizerModule()

    def quantize(self, param: torch.Tensor, groups: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 values, fp32 scales) of `param`, moved to the accelerator and converted to fp16 first.

        Raises:
            ValueError: `param` cannot be split into groups of a multiple of 8 elements.
        """
        if groups is None:
            numel = param.numel()
            groups = self.group_size_cache.get(numel)
            if groups is None:
                groups = self.group_size_cache[numel] = _num_groups(numel, self.target_group_size)
        module = self.quantizer_cuda_module
        # the kernel reads fp16: a bf16/fp32 tensor handed over as is would be misread
        param = param.to(ds_comm.get_accelerator().device(), dtype=torch.half)
        return module.quantize(param, groups, 8, module.Symmetric)

    def dequantize(
        self, quantized_param: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype | None = None
    ) -> torch.Tensor:
        """The values back from `quantize`'s output (fp16 from the kernel; `dtype` when given)."""
        module = self.quantizer_cuda_module
        out = module.dequantize(quantized_param, scale, scale.numel(), 8, module.Symmetric)
        return out.to(dtype) if dtype is not None and out.dtype != dtype else out


@dataclasses.dataclass(frozen=True)
class GroupQuantizer:
    """Quantize a tensor to `num_bits` unsigned codes in groups along `group_dim`, each with its own min and step.

    Args:
        num_bits: 8 or 4 (4-bit codes are packed two per byte along the last dimension).
        group_size: values per group; must divide the tensor's size along `group_dim`.
        group_dim: the dimension the groups run along.
        symmetric: each group's range is `[-max|x|, max|x|]` instead of `[min x, max x]`.

    Raises:
        ValueError: `num_bits` not 4 or 8, or `group_size` < 1 or `group_dim` < 0.
    """

    num_bits: int
    group_size: int
    group_dim: int
    symmetric: bool = False

    def __post_init__(self) -> None:
        if self.num_bits not in (4, 8):
            raise ValueError(f"GroupQuantizer(num_bits={self.num_bits}): only 4 and 8 bits are supported")
        if self.group_size < 1 or self.group_dim < 0:
            raise ValueError(
                f"GroupQuantizer(group_size={self.group_size}, group_dim={self.group_dim}): group_size must be "
                "positive and group_dim non-negative"
            )

    @property
    def levels(self) -> int:
        """The largest code, `2**num_bits - 1`."""
        return 2**self.num_bits - 1

    def _grouped_shape(self, shape: torch.Size) -> tuple[int, ...]:
        dim = self.group_dim
        if dim >= len(shape) or shape[dim] % self.group_size:
            raise ValueError(
                f"cannot quantize a tensor of shape {tuple(shape)} in groups of {self.group_size} along dimension "
                f"{dim}: the dimension must exist and be a multiple of group_size"
            )
        if self.num_bits == 4 and shape[-1] % 2:
            raise ValueError(f"4-bit codes are packed in pairs along the last dimension; {tuple(shape)} is odd there")
        return (*shape[:dim], shape[dim] // self.group_size, self.group_size, *shape[dim + 1 :])

    def quantize(
        self, tensor: torch.Tensor, dtype: torch.dtype | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`(codes, step, min)`: uint8 codes shaped like `tensor` (last dimension halved at 4 bits), and the
        per-group step `(max - min) / (2**num_bits - 1)` and minimum (broadcastable against the grouped
        view) in `dtype` (default `tensor`'s).

        The step and minimum are rounded to `dtype` before the codes are computed, so dequantizing with the
        stored values is what the bound above describes. (DeepSpeed stores the reciprocal of the step,
        which overflows fp16 for groups whose range is under 0.004; the step does not.)
        """
        grouped = tensor.detach().reshape(self._grouped_shape(tensor.shape)).float()
        reduce_dim = self.group_dim + 1
        low, high = grouped.amin(dim=reduce_dim, keepdim=True), grouped.amax(dim=reduce_dim, keepdim=True)
        if self.symmetric:
            high = torch.maximum(high.abs(), low.abs())
            low = -high
        out_dtype = dtype or tensor.dtype
        step, low = ((high - low) / self.levels).to(out_dtype), low.to(out_dtype)
        safe = torch.where(step > 0, step.float(), 1.0)  # a constant group: every code 0, value = its min
        codes = ((grouped - low.float()) / safe).clamp_(0, self.levels).round_().to(torch.uint8)
        codes = codes.reshape(tensor.shape)
        if self.num_bits == 4:
            codes = codes[..., 0::2].bitwise_left_shift(4).bitwise_or_(codes[..., 1::2])
        return codes, step, low

    def dequantize(
        self, codes: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """The values `codes * step + min` in `dtype`, shaped like the quantized tensor."""
        if self.num_bits == 4:
            unpacked = torch.empty((*codes.shape[:-1], codes.shape[-1] * 2), dtype=torch.uint8, device=codes.device)
            unpacked[..., 0::2] = codes.bitwise_right_shift(4)
            unpacked[..., 1::2] = codes.bitwise_and(0xF)
            codes = unpacked
        grouped = codes.reshape(self._grouped_shape(codes.shape)).float()
        values = grouped * step.float() + minimum.float()
        return values.reshape(codes.shape).to(dtype)
