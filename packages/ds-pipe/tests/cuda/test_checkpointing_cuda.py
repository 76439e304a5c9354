"""Activation checkpointing on a CUDA device: dropout drawn from the device's generator is replayed exactly.

A stack of dropout MLP blocks on the GPU, each block checkpointed, against the same stack run
without checkpointing: the gradients are bit-identical (`torch.equal`) with the default storage,
with `cpu_checkpointing` (saved inputs parked in host memory, copied back for the recomputation)
and with `contiguous_memory_optimization`, and for the tensor-parallel tracker's named stream.
Checkpointing must also pay for itself: the peak device memory of forward + backward is lower
than without it.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from ds_pipe import checkpointing

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEVICE = "cuda"
WIDTH, DEPTH = 512, 6


class Block(nn.Module):
    def __init__(self, tracked: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)
        self.drop = nn.Dropout(0.2)
        self.tracked = tracked

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.gelu(self.fc1(x))
        if self.tracked:  # dropout from the tracker's model-parallel stream, as Megatron-style code does
            with checkpointing.get_cuda_rng_tracker().fork():
                h = self.drop(h)
        else:
            h = self.drop(h)
        return x + self.fc2(h)


@pytest.fixture(autouse=True)
def fresh_configuration() -> Iterator[None]:
    checkpointing.reset()
    yield
    checkpointing.reset()


def _blocks(tracked: bool = False) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(Block(tracked) for _ in range(DEPTH)).to(DEVICE)


def _grads(blocks: nn.ModuleList, use_checkpoint: bool, x: torch.Tensor) -> list[torch.Tensor]:
    torch.manual_seed(7)
    if DEVICE == "cuda":
        torch.cuda.manual_seed(7)
    x = x.clone().requires_grad_()
    h = x
    for block in blocks:
        h = checkpointing.checkpoint(block, h) if use_checkpoint else block(h)
    h.pow(2).mean().backward()
    grads = [x.grad.clone(), *(p.grad.clone() for p in blocks.parameters())]
    blocks.zero_grad(set_to_none=True)
    return grads


def _input() -> torch.Tensor:
    return torch.randn(64, 128, WIDTH, generator=torch.Generator().manual_seed(3)).to(DEVICE)


@pytest.mark.parametrize("storage", ["default", "cpu_checkpointing", "contiguous"])
def test_checkpointed_grads_are_bit_identical_on_cuda(storage: str) -> None:
    section = {
        "default": {},
        "cpu_checkpointing": {"cpu_checkpointing": True},
        "contiguous": {"contiguous_memory_optimization": True, "number_checkpoints": DEPTH},
    }[storage]
    checkpointing.configure(None, deepspeed_config={"activation_checkpointing": section})
    blocks = _blocks()
    x = _input()
    plain = _grads(blocks, False, x)
    ours = _grads(blocks, True, x)
    for a, b in zip(plain, ours, strict=True):
        assert torch.equal(a, b)


def test_tracker_stream_dropout_is_replayed_on_cuda() -> None:
    checkpointing.model_parallel_cuda_manual_seed(1234)
    blocks = _blocks(tracked=True)
    x = _input()
    states = checkpointing.get_cuda_rng_tracker().get_states()
    plain = _grads(blocks, False, x)
    checkpointing.get_cuda_rng_tracker().set_states(states)
    ours = _grads(blocks, True, x)
    for a, b in zip(plain, ours, strict=True):
        assert torch.equal(a, b)


def test_checkpointing_lowers_peak_device_memory() -> None:
    blocks = _blocks()
    x = _input()
    peaks = {}
    for use_checkpoint in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        _grads(blocks, use_checkpoint, x)
        torch.cuda.synchronize()
        peaks[use_checkpoint] = torch.cuda.max_memory_allocated() - base
    # Without checkpointing every block keeps fc1's output, the GELU and the dropout mask (~4x the
    # hidden width per token); with it only the block inputs stay, plus one block during recomputation.
    assert peaks[True] < 0.6 * peaks[False], peaks
