"""`CUDAQuantizer` (ZeRO++ weights): symmetric int8 in groups, checked against a plain-PyTorch reference."""

from __future__ import annotations

import pytest
import torch

from ds_zero import CUDAQuantizer
from ds_zero._quantizer import TorchQuantizerModule


def _reference(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per group of the fp16 input: scale = max|x| / 127, q = round(x / scale); back: q * scale, in fp16."""
    rows = x.half().float().reshape(groups, -1)
    scale = rows.abs().max(dim=1).values / 127
    q = torch.round(rows / scale[:, None])
    return q.reshape(-1), (q * scale[:, None]).reshape(-1).half()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_matches_the_reference_and_keeps_the_dtype(dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    x = (torch.randn(24_000) * torch.linspace(0.01, 5, 24_000)).to(dtype)  # groups of very different ranges
    quantizer = CUDAQuantizer()
    q, scales = quantizer.quantize(x)
    assert q.dtype == torch.int8 and scales.dtype == torch.float32
    groups = scales.numel()
    assert groups == 3  # 24000 elements: three groups of 8000
    ref_q, ref_values = _reference(x, groups)
    assert torch.equal(q.reshape(-1).float(), ref_q)
    back = quantizer.dequantize(q, scales, dtype=dtype)
    assert back.dtype == dtype
    torch.testing.assert_close(back.float(), ref_values.to(dtype).float(), atol=0, rtol=0)
    # each value within half a step of its group's scale, plus the fp16 and output roundings
    rows = x.float().reshape(groups, -1)
    err = (back.float().reshape(groups, -1) - rows).abs().max(dim=1).values
    rounding = rows.abs().max(dim=1).values * (2 * torch.finfo(torch.half).eps + torch.finfo(dtype).eps)
    assert bool((err <= scales * 0.5 + rounding).all())
    assert quantizer.dequantize(q, scales).dtype == torch.half  # the kernel's own output without dtype=


def test_group_count_follows_deepspeeds_rule() -> None:
    q = CUDAQuantizer()
    for numel, groups in [(4096, 1), (8000, 1), (8008, 7), (64_000, 8), (131_072, 32)]:
        _, scales = q.quantize(torch.ones(numel))
        assert scales.numel() == groups, numel
        assert CUDAQuantizer.group_size_cache[numel] == groups


def test_sizes_that_do_not_split_into_groups_of_eight_are_refused() -> None:
    with pytest.raises(ValueError, match="1001 elements do not"):
        CUDAQuantizer().quantize(torch.ones(1001))


def test_zero_group_stays_zero() -> None:
    x = torch.zeros(16)
    x[8:] = torch.arange(8.0)
    q, scales = CUDAQuantizer().quantize(x, groups=2)
    assert scales[0] == 0 and torch.equal(q[:8], torch.zeros(8, dtype=torch.int8))
    torch.testing.assert_close(CUDAQuantizer().dequantize(q, scales, dtype=torch.float32), x, atol=0.03, rtol=0)


def test_the_kernel_module_is_replaceable(monkeypatch: pytest.MonkeyPatch) -> None:
    seen = []

    class Recorder(TorchQuantizerModule):
        def quantize(self, x, groups, num_bits, quant_type):  # type: ignore[no-untyped-def]
            seen.append((x.dtype, groups, num_bits, quant_type))
            return super().quantize(x, groups, num_bits, quant_type)

    monkeypatch.setattr(CUDAQuantizer, "quantizer_cuda_module", Recorder())
    CUDAQuantizer().quantize(torch.ones(16, dtype=torch.bfloat16), groups=2)
    assert seen == [(torch.half, 2, 8, TorchQuantizerModule.Symmetric)]  # handed fp16, as DeepSpeed's kernel
