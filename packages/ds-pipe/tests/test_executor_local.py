"""PipelineExecutor on one stage: gradient accumulation against plain PyTorch, eval modes, hooks and errors."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

from ds_pipe import LayerSpec, PipelineExecutor, PipelineModule


def _data(n: int, rows: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(rows, 4, generator=g), torch.randn(rows, 2, generator=g)) for _ in range(n)]


def _module(loss_fn: Callable | None = nn.functional.mse_loss) -> PipelineModule:
    torch.manual_seed(0)
    return PipelineModule(
        [LayerSpec(nn.Linear, 4, 5), nn.Tanh(), LayerSpec(nn.Linear, 5, 2)], num_stages=1, loss_fn=loss_fn
    )


def test_train_batch_matches_gradient_accumulation() -> None:
    module = _module()
    reference = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 2))
    reference.load_state_dict(module.state_dict())  # same names: "0.weight", "2.bias", ...
    calls: list[str] = []
    grads: dict[str, torch.Tensor] = {}

    def step() -> None:
        calls.append("step")
        grads.update({n: p.grad.clone() for n, p in module.named_parameters()})

    executor = PipelineExecutor(
        module,
        micro_batches=4,
        optimizer_step=step,
        reduce_grads=lambda: calls.append("reduce"),
        scale_loss=lambda loss: loss * 8,
        batch_fn=lambda batch: (batch[0] * 2, batch[1]),
    )
    loss = executor.train_batch(iter(_data(4)))
    losses = [nn.functional.mse_loss(reference(x * 2), y) for x, y in _data(4)]
    (sum(losses) / 4 * 8).backward()
    assert calls == ["reduce", "step"]
    torch.testing.assert_close(loss, torch.stack(losses).mean().detach(), rtol=0, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=1e-6)
    assert set(executor.timings()) >= {"LoadMicroBatch", "ForwardPass", "BackwardPass", "OptimizerStep", "batch"}


def test_eval_batch_modes() -> None:
    module = _module()
    executor = PipelineExecutor(module, micro_batches=2)
    data = _data(3)
    expected = [nn.functional.mse_loss(module(x), y).detach() for x, y in data]
    avg = executor.eval_batch(iter(data), num_micro_batches=3)
    torch.testing.assert_close(avg, torch.stack(expected).mean(), rtol=0, atol=1e-6)
    per, logits = executor.eval_batch(iter(data), reduce_output=None, return_logits=True, num_micro_batches=3)
    assert all(torch.equal(a, b) for a, b in zip(per, expected, strict=False)) and len(logits) == 3
    outputs = executor.eval_batch(iter(data[:2]), compute_loss=False, reduce_output="avg")
    torch.testing.assert_close(outputs, torch.stack([module(x) for x, _ in data[:2]]).mean(0).detach())
    assert module.training, "eval_batch restores the training mode"


def test_executor_errors_are_named() -> None:
    module = _module()
    with pytest.raises(TypeError, match="module must be a PipelineModule, got Linear"):
        PipelineExecutor(nn.Linear(2, 2), micro_batches=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="micro_batches must be an int >= 1, got 0"):
        PipelineExecutor(module, micro_batches=0)
    executor = PipelineExecutor(module, micro_batches=2)
    with torch.no_grad(), pytest.raises(RuntimeError, match="requires gradients enabled. Use eval_batch"):
        executor.train_batch(iter(_data(2)))
    with pytest.raises(ValueError, match="stage 0 \\(the first stage\\) reads data"):
        executor.train_batch()
    with pytest.raises(TypeError, match="must be an \\(inputs, labels\\) pair, got tuple of length 3"):
        executor.train_batch(iter([(torch.zeros(1, 4), torch.zeros(1, 2), 1)] * 2))
    with pytest.raises(ValueError, match="reduce_output must be 'avg' or None, got 'sum'"):
        executor.eval_batch(iter(_data(2)), reduce_output="sum")
    no_loss = PipelineExecutor(_module(loss_fn=None), micro_batches=2)
    with pytest.raises(ValueError, match=r"the loss on the last stage must be a scalar tensor, got \(3, 2\)"):
        no_loss.train_batch(iter(_data(2)))
    executor.set_dataiterator(iter(_data(2)))
    assert executor.train_batch().dim() == 0


def test_a_one_element_output_is_the_loss_without_a_loss_fn() -> None:
    # A last Linear(h, 1) on one row gives a (1, 1) output; like DeepSpeed, it is taken as the loss.
    torch.manual_seed(0)
    module = PipelineModule([LayerSpec(nn.Linear, 4, 3), nn.Tanh(), LayerSpec(nn.Linear, 3, 1)], num_stages=1)
    reference = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 1))
    reference.load_state_dict(module.state_dict())
    data = [(x[:1], y[:1]) for x, y in _data(2)]
    loss = PipelineExecutor(module, micro_batches=2).train_batch(iter(data))
    outputs = [reference(x) for x, _ in data]
    (sum(outputs) / 2).sum().backward()
    assert loss.dim() == 0
    torch.testing.assert_close(loss, torch.stack([o.reshape(()) for o in outputs]).mean().detach(), rtol=0, atol=1e-6)
    for name, p in reference.named_parameters():
        torch.testing.assert_close(dict(module.named_parameters())[name].grad, p.grad, rtol=0, atol=1e-6)
