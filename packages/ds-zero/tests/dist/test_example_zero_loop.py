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

CONFIGS = [(2, "fp16"), (1, "bf16")]


def _both(rank: int, world: int) -> list[list[float]]:
    return [zero_in_your_loop.train(rank, world, steps=40, stage=stage, dtype=dtype) for stage, dtype in CONFIGS]


def test_example_trains_on_two_ranks() -> None:
    r0, r1 = run_ranks(2, _both, timeout_s=150)
    for (stage, dtype), a, b in zip(CONFIGS, r0, r1, strict=True):
        assert a == b, f"stage {stage} {dtype}: ranks must agree on the (all-reduced) losses"
        assert all(math.isfinite(v) for v in a)
        assert sum(a[-5:]) / 5 < 0.6 * sum(a[:5]) / 5, (stage, dtype, a)
