"""Group-wise small-float quantization (FP8/FP12/FP6/FP4) in plain PyTorch, so it runs on any device.

DeepSpeed's FP quantizer is a CUDA kernel; this one computes the same format with tensor ops:

- values are split into groups of `group_size`; each group is scaled so that its largest magnitude
  lands on the format's target range (`Q_RANGE`: 480 for E4M3, 114688 for E5M2, 510 for 12 bits,
  28 for E3M2, 6 for E2M1) and the scale `absmax / q_range` is kept as fp32;
- each scaled value is rounded to the nearest value of a 1-sign/E-exponent/M-mantissa format with
  IEEE-style bias and subnormals, and no codes reserved for inf/nan (the top exponent holds numbers);
- codes are packed little-endian into bytes: one row per group of `group_size * q_bits / 8` bytes
  followed by the scale's 4 bytes, the layout DeepSpeed's kernel writes.

[Note: the code arithmetic] With `e = clamp(floor(log2 |y|), emin)` and `m = round(|y| / 2^(e - M))`,
the magnitude code `(e - emin) * 2^M + m` is the format's bit pattern for normals (exponent field
`e - emin + 1`, mantissa `m - 2^M`) and for subnormals (`e = emin`, `m < 2^M`: exponent field 0), and
a mantissa that rounds up to `2^(M+1)` carries into the exponent by itself. So one expression encodes
every value, and the codes are ordered like the values they stand for.
"""

from __future__ import annotations

import logging
import math

import torch

from ds_engine._linear.config import FIXED_MANTISSA, QuantizationConfig, check_quantization_config

logger = logging.getLogger(__name__)

__all__ = ["FPQuantizer", "fp_format", "max_relative_error"]

#: (q_bits, mantissa_bits) -> the magnitude a group's largest value is scaled to.
Q_RANGE = {(8, 3): 480.0, (8, 2): 114688.0, (12, 4): 510.0, (6, 2): 28.0, (4, 1): 6.0}
#: Bytes of a group's fp32 scale, stored after its codes.
SCALE_BYTES = 4


def fp_format(q_bits: int, mantissa_bits: int) -> tuple[int, int]:
    """`(exponent_bits, mantissa_bits)` of the `q_bits` format (12, 6 and 4 bits fix their mantissa)."""
    mantissa = FIXED_MANTISSA.get(q_bits, mantissa_bits)
    return q_bits - 1 - mantissa, mantissa


def max_relative_error(q_bits: int, mantissa_bits: int) -> float:
    """The largest relative rounding error of a normal value in the format: half a unit in the last place."""
    return 2.0 ** -(fp_format(q_bits, mantissa_bits)[1] + 1)


class FPQuantizer:
    """Quantizes one tensor and dequantizes it back; keeps the tensor's shape and dtype to do so.

    DeepSpeed's quantizer object is stateful in the same way (one per parameter): `dequantize` needs
    the original shape and dtype, which the packed bytes do not carry.

    Args:
        quantization_config: q_bits, mantissa_bits and group_size (`QuantizationConfig`).
    """

    def __init__(self, quantization_config: QuantizationConfig | None = None) -> None:
        self.q_config = check_quantization_config(quantization_config or QuantizationConfig())
        self.group_size = self.q_config.group_size
        self.orig_dtype: torch.dtype | None = None
        self.orig_shape: torch.Size | None = None

    # -- the format ------------------------------------------------------------------------------
    def _format(self, q_bits: int, q_mantisa_bits: int) -> tuple[int, int, int, float]:
        """(exponent bits, mantissa bits, emin, q_range) for the call's bits."""
        exp_bits, man_bits = fp_format(q_bits, q_mantisa_bits)
        if (q_bits, man_bits) not in Q_RANGE:
            raise ValueError(f"q_bits={q_bits} with mantissa_bits={q_mantisa_bits} is not a supported format")
        bias = 2 ** (exp_bits - 1) - 1
        return exp_bits, man_bits, 1 - bias, Q_RANGE[(q_bits, man_bits)]

    def _values_per_word(self, q_bits: int) -> int:
        """How many codes fill a whole number of bytes (8 bits: 1, 4: 2, 6: 4, 12: 2)."""
        return 8 // math.gcd(8, q_bits)

    # -- quantize --------------------------------------------------------------------------------
    def quantize(self, input: torch.Tensor, q_bits: int = 8, q_mantisa_bits: int = 3) -> torch.Tensor:
        """`input` as packed bytes: `(num_groups, group_size * q_bits / 8 + 4)` uint8.

        A tensor whose size is not a multiple of `group_size` gets a last group padded with zeros.
        """
        if not input.is_floating_point():
            raise TypeError(f"FPQuantizer.quantize takes a floating-point tensor, got {input.dtype}")
        exp_bits, man_bits, emin, q_range = self._format(q_bits, q_mantisa_bits)
        self.orig_dtype, self.orig_shape = input.dtype, input.shape
        flat = input.detach().reshape(-1).float()
        groups = -(-flat.numel() // self.group_size)
        padded = torch.zeros(groups * self.group_size, dtype=torch.float32, device=flat.device)
        padded[: flat.numel()] = flat
        x = padded.view(groups, self.group_size)
        absmax = x.abs().amax(dim=1, keepdim=True)
        scale = torch.where(absmax > 0, absmax / q_range, torch.ones_like(absmax))
        y = x / scale
        magnitude = y.abs()
        _, exponent = torch.frexp(magnitude)  # magnitude = f * 2^exponent, f in [0.5, 1)
        e = torch.clamp(torch.where(magnitude > 0, exponent - 1, emin), min=emin)  # zero: code 0
        m = torch.round(magnitude / torch.exp2((e - man_bits).float()))
        top = 2 ** (exp_bits + man_bits) - 1  # the largest magnitude code (saturate there)
        code = torch.clamp((e - emin).to(torch.int32) * 2**man_bits + m.to(torch.int32), max=top)
        code = code | (torch.signbit(y).to(torch.int32) << (exp_bits + man_bits))
        return torch.cat([self._pack(code, q_bits), scale.view(torch.uint8).view(groups, SCALE_BYTES)], dim=1)

    def _pack(self, code: torch.Tensor, q_bits: int) -> torch.Tensor:
        groups = code.shape[0]
        per_word = self._values_per_word(q_bits)
        words = code.view(groups, -1, per_word)
        shifts = torch.arange(per_word, device=code.device, dtype=torch.int32) * q_bits
        word = (words << shifts).sum(dim=-1, dtype=torch.int32)  # no overlap: sum == bitwise or
        nbytes = per_word * q_bits // 8
        byte_shifts = torch.arange(nbytes, device=code.device, dtype=torch.int32) * 8
        packed = (word.unsqueeze(-1) >> byte_shifts) & 0xFF
        return packed.reshape(groups, -1).to(torch.uint8)

    # -- dequantize ------------------------------------------------------------------------------
    def dequantize(
        self, input_q: torch.Tensor, fp_out: torch.Tensor | None = None, q_bits: int = 8, q_mantisa_bits: int = 3
    ) -> torch.Tensor:
        """The tensor `quantize` was given, to the format's precision, in its shape and dtype."""
        if self.orig_dtype is None or self.orig_shape is None:
            raise RuntimeError("FPQuantizer.dequantize: call quantize first (it records the shape and dtype)")
        exp_bits, man_bits, emin, _ = self._format(q_bits, q_mantisa_bits)
        groups = input_q.shape[0]
        scale = input_q[:, -SCALE_BYTES:].contiguous().view(torch.float32)  # (groups, 1)
        code = self._unpack(input_q[:, :-SCALE_BYTES], q_bits, groups)
        sign = (code >> (exp_bits + man_bits)) & 1
        magnitude_code = code & (2 ** (exp_bits + man_bits) - 1)
        exp_field = magnitude_code >> man_bits
        mantissa = (magnitude_code & (2**man_bits - 1)).float()
        significand = torch.where(exp_field > 0, mantissa + 2**man_bits, mantissa)
        power = (torch.clamp(exp_field - 1, min=0) + emin - man_bits).float()
        value = significand * torch.exp2(power) * (1.0 - 2.0 * sign.float()) * scale
        numel = math.prod(self.orig_shape)
        out = value.reshape(-1)[:numel].reshape(self.orig_shape).to(self.orig_dtype)
        if fp_out is not None:
            return fp_out.copy_(out)
        return out

    def _unpack(self, packed: torch.Tensor, q_bits: int, groups: int) -> torch.Tensor:
        per_word = self._values_per_word(q_bits)
        nbytes = per_word * q_bits // 8
        byte_shifts = torch.arange(nbytes, device=packed.device, dtype=torch.int32) * 8
        word = (packed.view(groups, -1, nbytes).to(torch.int32) << byte_shifts).sum(dim=-1, dtype=torch.int32)
        shifts = torch.arange(per_word, device=packed.device, dtype=torch.int32) * q_bits
        return ((word.unsqueeze(-1) >> shifts) & (2**q_bits - 1)).reshape(groups, -1)

    def to(self, *args: object, **kwargs: object) -> None:
        """Nothing to move: the packed bytes hold the scales (DeepSpeed's quantizer keeps device buffers)."""
