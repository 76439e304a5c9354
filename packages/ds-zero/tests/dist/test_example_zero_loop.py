"""The standalone example (examples/zero_in_your_loop.py: ds_zero + ds_comm in a plain loop) trains on 2 ranks."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from ds_comm.testing import run_ranks

EXAMPLES = Path(__file__).resolve().parents[4] / "examples"
if not (EXAMPLES / "zero_in_your_loop.py").is_file():
    pytest.skip("examples/ is not in this tree", allow_module_level=True)
sys.path.insert(0, str(EXAMPLES))

import zero_in_your_loop  # noqa: E402


@pytest.mark.parametrize(("stage", "dtype"), [(2, "fp16"), (1, "bf16")])
def test_example_trains_on_two_ranks(stage: int, dtype: str) -> None:
    r0, r1 = run_ranks(2, zero_in_your_loop.train, steps=40, stage=stage, dtype=dtype, timeout_s=120)
    assert r0 == r1, "ranks must agree on the (all-reduced) losses"
    assert all(math.isfinite(v) for v in r0)
    assert sum(r0[-5:]) / 5 < 0.6 * sum(r0[:5]) / 5, r0
