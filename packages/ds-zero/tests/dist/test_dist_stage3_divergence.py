"""A forward that differs across ranks fails with an error naming the module and the ranks, never hangs.

Two cases: the divergence happens on the first iteration (every gather is fingerprinted: all ranks
fail at once, naming what each rank gathered), and after the execution order was recorded (gathers
follow the trace unchecked; the rank that left it reports itself through the store, and every rank
fails within the collective timeout).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from stage3_cases import STAGE3_CFG, TinyGPT, batch, loss_fn

import ds_zero
from ds_comm.testing import run_ranks


class SkippingGPT(TinyGPT):
    """Skips `blocks.1` when told to (data-dependent control flow on one rank)."""

    skip = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[self.pos[: idx.shape[1]]]
        for i, block in enumerate(self.blocks):
            if not (self.skip and i == 1):
                x = block(x)
        return self.lm_head(self.ln_f(x))


def _diverge(rank: int, world: int, at_step: int) -> Any:
    torch.manual_seed(0)
    model = SkippingGPT()
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config=STAGE3_CFG)
    for step in range(at_step + 1):
        model.skip = rank == 1 and step == at_step
        idx, tgt = batch(rank, step, 0)
        opt.backward(loss_fn(model(idx), tgt))
        opt.step()
        opt.zero_grad()
    return "finished"


def test_divergence_on_the_first_iteration_names_modules_and_ranks() -> None:
    with pytest.raises(ds_zero.GatherDivergenceError) as info:
        run_ranks(2, _diverge, at_step=0, timeout_s=60)
    text = str(info.value)
    assert "ranks diverged" in text
    assert "ranks [0] gather module 'blocks.1.fc1'" in text
    assert "ranks [1] gather module 'lm_head'" in text  # rank 1 skipped blocks.1 (ln_f is persistent)


def test_divergence_after_the_trace_is_recorded_fails_within_the_collective_timeout() -> None:
    with pytest.raises(ds_zero.GatherDivergenceError) as info:
        run_ranks(2, _diverge, at_step=2, timeout_s=90, collective_timeout_s=10)
    text = str(info.value)
    assert "rank 1 ran module" in text and "where the recorded execution order expected module 'blocks.1" in text
