"""The kernels' fp16/bf16 tile conversions equal torch's casts bit for bit: the _Float16/F16C path
and the portable bit-manipulation path (compiled with -DDS_SOFT_HALF), on every fp16 value and on
floats around every rounding boundary."""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import ClassVar

import pytest
import torch

from ds_ops.op_builder import OpBuilder
from ds_ops.op_builder._base import CSRC_ROOT

SOURCE = """#include "ds_cpu_optim.h"
DS_DEFINE_OP_INFO()
DS_EXPORT void widen(const void* src, int32_t dtype, float* dst, int64_t n) {
  const float* view = ds::load_tile(const_cast<void*>(src), dtype, 0, n, dst);
  if (view != dst) for (int64_t i = 0; i < n; ++i) dst[i] = view[i];
}
DS_EXPORT void narrow(const float* src, int32_t dtype, void* dst, int64_t n) { ds::store_tile(dst, dtype, 0, n, src); }
"""


class ConversionBuilder(OpBuilder):
    NAME = "conversion_probe"
    SOURCES = ("conversion.cpp",)
    _ptr, _i32, _i64 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64
    FUNCTIONS: ClassVar = {"widen": (None, (_ptr, _i32, _ptr, _i64)), "narrow": (None, (_ptr, _i32, _ptr, _i64))}

    def __init__(self, root: Path, soft: bool) -> None:
        super().__init__()
        self.name = f"conversion_probe_{'soft' if soft else 'native'}"
        self._root, self._soft = root, soft

    def csrc_root(self) -> Path:
        return self._root

    def include_paths(self) -> list[Path]:
        return [CSRC_ROOT / "includes"]

    def cxx_args(self) -> list[str]:
        return [*super().cxx_args(), *(["-DDS_SOFT_HALF"] if self._soft else [])]


@pytest.fixture(scope="module", params=[False, True], ids=["native", "soft"])
def library(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    root = tmp_path_factory.mktemp("conversion")
    (root / "conversion.cpp").write_text(SOURCE)
    return ConversionBuilder(root, soft=request.param).load()


def _narrow(library: ctypes.CDLL, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(values.numel(), dtype=dtype)
    library.narrow(values.data_ptr(), {torch.bfloat16: 1, torch.float16: 2}[dtype], out.data_ptr(), values.numel())
    return out


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = a.isnan() & b.isnan()  # any NaN payload is fine; torch's is canonical for bf16
    return bool(((a.view(torch.int16) == b.view(torch.int16)) | nan).all())


def test_every_half_widens_exactly(library: ctypes.CDLL) -> None:
    halves = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16)
    widened = torch.empty(halves.numel())
    library.widen(halves.data_ptr(), 2, widened.data_ptr(), halves.numel())
    expected = halves.float()
    assert torch.equal(widened.isnan(), expected.isnan())
    assert torch.equal(widened[~expected.isnan()], expected[~expected.isnan()])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_narrowing_rounds_like_torch(library: ctypes.CDLL, dtype: torch.dtype) -> None:
    grid = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    grid = grid[torch.isfinite(grid)]
    # every fp16 value, the midpoints to its neighbours (ties), and one float ulp either side of them
    mid = (grid[:-1].double() + grid[1:].double()).div(2).float()
    values = torch.cat(
        [
            grid,
            mid,
            torch.nextafter(mid, torch.tensor(float("inf"))),
            torch.nextafter(mid, torch.tensor(float("-inf"))),
            torch.randn(100_000, generator=torch.Generator().manual_seed(0)) * 1e3,
            torch.tensor(
                [
                    65504.0,
                    65519.99,
                    65520.0,
                    1e6,
                    -1e6,
                    float("inf"),
                    float("-inf"),
                    float("nan"),
                    3e-8,
                    2.9802322e-08,
                    6e-8,
                    1e-45,
                ]
            ),
        ]
    )
    assert _same_bits(_narrow(library, values, dtype), values.to(dtype))
