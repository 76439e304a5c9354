"""Which blocks of layers a `PipelineModule` checkpoints: decided once per interval, rebuilt when it changes."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ds_pipe import PipelineModule, checkpointing


def _relus_then_linears() -> list[nn.Module]:
    # parameter-free blocks are not checkpointed, so a misaligned result list shows in the output
    return [nn.ReLU() for _ in range(4)] + [nn.Linear(6, 6) for _ in range(4)]


def test_results_per_block_follow_the_interval() -> None:
    torch.manual_seed(0)
    module = PipelineModule(_relus_then_linears(), num_stages=1, activation_checkpoint_interval=4)
    assert module.is_checkpointable_results == []  # nothing decided before it is needed
    module._precompute_checkpointable_values()
    assert module.is_checkpointable_results == [False, True]
    module.set_checkpoint_interval(3)
    assert module.is_checkpointable_results == [False, True, True]  # [R R R] [R L L] [L L]
    module.set_checkpoint_interval(1)
    assert module.is_checkpointable_results == [False] * 4 + [True] * 4
    assert module.is_checkpointable_results_interval == 1


def test_forward_checkpoints_exactly_the_blocks_with_parameters() -> None:
    torch.manual_seed(0)
    module = PipelineModule(_relus_then_linears(), num_stages=1, activation_checkpoint_interval=3)
    calls: list[int] = []

    def counting_checkpoint(function: Any, *args: Any) -> Any:
        calls.append(len(args))
        return checkpointing.checkpoint(function, *args)

    module.activation_checkpoint_func = counting_checkpoint
    x = torch.randn(2, 6, requires_grad=True)
    out = module(x)
    assert len(calls) == 2  # blocks [R L L] and [L L]; [R R R] runs plainly
    module.set_checkpoint_interval(0)
    reference = module(x)
    torch.testing.assert_close(out, reference, rtol=0, atol=0)
    out.sum().backward()
    grads = [p.grad.clone() for p in module.parameters()]
    module.zero_grad()
    reference.sum().backward()
    for got, want in zip(grads, (p.grad for p in module.parameters()), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_changing_the_interval_attribute_directly_is_seen_by_forward() -> None:
    torch.manual_seed(0)
    module = PipelineModule(_relus_then_linears(), num_stages=1, activation_checkpoint_interval=4)
    x = torch.randn(2, 6)
    out = module(x)
    module.activation_checkpoint_interval = 3  # not through the setter
    torch.testing.assert_close(module(x), out, rtol=0, atol=0)
    assert module.is_checkpointable_results_interval == 3 and len(module.is_checkpointable_results) == 3
