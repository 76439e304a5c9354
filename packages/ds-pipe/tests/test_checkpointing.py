"""Activation checkpointing (one process): bit-identical gradients with dropout, RNG streams, storage options."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from ds_comm import ConfigError
from ds_pipe import checkpointing


@pytest.fixture(autouse=True)
def _fresh_state() -> Iterator[None]:
    checkpointing.reset()
    checkpointing.get_cuda_rng_tracker().reset()
    yield
    checkpointing.reset()
    checkpointing.get_cuda_rng_tracker().reset()


class Block(nn.Module):
    def __init__(self, width: int = 16, p: float = 0.3, use_tracker: bool = False) -> None:
        super().__init__()
        self.lin1, self.lin2, self.drop, self.use_tracker = (
            nn.Linear(width, width),
            nn.Linear(width, width),
            nn.Dropout(p),
            use_tracker,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin1(x))
        if self.use_tracker:
            with checkpointing.get_cuda_rng_tracker().fork():
                h = self.drop(h)
        else:
            h = self.drop(h)
        return self.drop(self.lin2(h)) + x


def _grads(
    blocks: nn.ModuleList, x: torch.Tensor, wrap: Callable[..., torch.Tensor] | None, steps: int = 2
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Run `steps` forward/backward passes from a fixed RNG state; return param grads and the input grad."""
    torch.manual_seed(123)
    blocks.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    for _ in range(steps):
        h = x
        for block in blocks:
            h = wrap(block, h) if wrap is not None else block(h)
        h.pow(2).mean().backward()
    return [p.grad.clone() for p in blocks.parameters()], x.grad.clone()


def _model(use_tracker: bool = False) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList([Block(use_tracker=use_tracker) for _ in range(3)])


def _assert_identical(a: tuple[list[torch.Tensor], torch.Tensor], b: tuple[list[torch.Tensor], torch.Tensor]) -> None:
    assert all(torch.equal(x, y) for x, y in zip(a[0], b[0], strict=False))
    assert torch.equal(a[1], b[1])


def test_checkpoint_gives_bit_identical_grads_with_dropout() -> None:
    blocks, x = _model(), torch.randn(8, 16)
    plain = _grads(blocks, x, None)
    ckpt = _grads(blocks, x, checkpointing.checkpoint)
    _assert_identical(plain, ckpt)
    # Sanity: the masks really are random (a different seed changes the gradients).
    torch.manual_seed(7)
    assert not torch.equal(_grads(blocks, x, None)[1], _grads(blocks, x, lambda b, h: b(h * 1.0001))[1])


def test_checkpoint_restores_tracker_streams() -> None:
    checkpointing.model_parallel_cuda_manual_seed(42)
    blocks, x = _model(use_tracker=True), torch.randn(8, 16)
    states = checkpointing.get_cuda_rng_tracker().get_states()
    plain = _grads(blocks, x, None)
    checkpointing.get_cuda_rng_tracker().set_states(states)
    ckpt = _grads(blocks, x, checkpointing.checkpoint)
    _assert_identical(plain, ckpt)


def test_tracker_fork_leaves_the_default_stream_alone() -> None:
    tracker = checkpointing.get_cuda_rng_tracker()
    tracker.add("mine", 5)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    with tracker.fork("mine"):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)
    torch.manual_seed(5)
    assert torch.equal(inside, torch.rand(3))
    with pytest.raises(ValueError, match="seed 5 is already used"):
        tracker.add("other", 5)
    with pytest.raises(ValueError, match="stream 'mine' already exists"):
        tracker.add("mine", 6)
    with pytest.raises(KeyError, match="no stream 'missing'"):
        with tracker.fork("missing"):
            pass


def test_inputs_without_grad_still_give_parameter_grads() -> None:
    lin = nn.Linear(4, 4)
    x = torch.randn(2, 4)  # raw data, as on the first pipeline stage
    checkpointing.checkpoint(lin, x).sum().backward()
    ref = nn.Linear(4, 4)
    ref.load_state_dict(lin.state_dict())
    ref(x).sum().backward()
    assert torch.equal(lin.weight.grad, ref.weight.grad) and torch.equal(lin.bias.grad, ref.bias.grad)


def test_tuples_non_tensor_args_kwargs_and_no_grad() -> None:
    lin = nn.Linear(4, 4)

    def fn(h: torch.Tensor, mask: torch.Tensor, scale: float, *, shift: float) -> tuple[torch.Tensor, torch.Tensor]:
        return lin(h) * scale * mask + shift, mask

    h = torch.randn(2, 4, requires_grad=True)
    mask = torch.ones(2, 1, dtype=torch.int64)
    out, mask_out = checkpointing.checkpoint(fn, h, mask, 2.0, shift=1.0)
    assert not mask_out.requires_grad and torch.equal(mask_out, mask)
    out.sum().backward()
    h2 = h.detach().clone().requires_grad_(True)
    fn(h2, mask, 2.0, shift=1.0)[0].sum().backward()
    assert torch.equal(h.grad, h2.grad)
    with torch.no_grad():
        out, _ = checkpointing.checkpoint(fn, h, mask, 2.0, shift=1.0)
    assert out.grad_fn is None


def test_cpu_and_contiguous_storage_give_identical_grads(caplog: pytest.LogCaptureFixture) -> None:
    blocks, x = _model(), torch.randn(8, 16)
    plain = _grads(blocks, x, None)
    checkpointing.configure(
        None,
        {
            "activation_checkpointing": {
                "cpu_checkpointing": True,
                "contiguous_memory_optimization": True,
                "number_checkpoints": 3,
                "synchronize_checkpoint_boundary": True,
                "profile": True,
            }
        },
    )
    assert checkpointing.is_configured()
    _assert_identical(plain, _grads(blocks, x, checkpointing.checkpoint))
    timings = checkpointing.timings()
    assert timings["calls"] == 6 and timings["forward"] > 0 and timings["recompute"] > 0
    # Fewer slots than live checkpoints: the extras use fresh memory, with one warning, same grads.
    checkpointing.set_num_layers(1)
    _assert_identical(plain, _grads(blocks, x, checkpointing.checkpoint))
    assert "more than number_checkpoints=1 checkpoints are alive at once" in caplog.text


def test_configure_sources_and_overrides(tmp_path: Path) -> None:
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 8, "activation_checkpointing": {"cpu_checkpointing": True}}))
    checkpointing.configure(None, str(path))
    assert checkpointing._state.config.cpu_checkpointing
    checkpointing.configure(None, {"cpu_checkpointing": True}, checkpoint_in_cpu=False, profile=True)
    assert not checkpointing._state.config.cpu_checkpointing and checkpointing._state.config.profile
    checkpointing.configure(None, {"train_batch_size": 8})  # a whole config without the section: defaults
    assert checkpointing._state.config == checkpointing.ActivationCheckpointingConfig()
    with pytest.raises(ConfigError, match="activation_checkpointing.cpu_checkpointin: unknown key"):
        checkpointing.configure(None, {"cpu_checkpointin": True, "profile": False})
    with pytest.raises(ConfigError, match="needs number_checkpoints"):
        checkpointing.configure(None, contiguous_checkpointing=True)
    with pytest.warns(UserWarning, match="partition_activations has no effect without tensor parallelism"):
        checkpointing.configure(None, partition_activations=True)
    checkpointing.reset()
    assert not checkpointing.is_configured()


def test_deepspeed_module_globals_read_the_configuration() -> None:
    names = ("PARTITION_ACTIVATIONS", "CONTIGUOUS_CHECKPOINTING", "CPU_CHECKPOINT", "SYNCHRONIZE", "PROFILE_TIME")
    assert [getattr(checkpointing, name) for name in names] == [False] * 5
    assert checkpointing.num_layers is None and checkpointing.mpu is None
    assert checkpointing.deepspeed_checkpointing_enabled is False

    class OneRankMpu:  # a Megatron-style mpu with a model-parallel group of one rank
        def get_model_parallel_group(self) -> None:
            return None

        def get_model_parallel_rank(self) -> int:
            return 0

        def get_model_parallel_world_size(self) -> int:
            return 1

    mpu = OneRankMpu()
    with pytest.warns(UserWarning, match="no effect without tensor parallelism"):
        checkpointing.configure(
            mpu, {"cpu_checkpointing": True, "profile": True}, partition_activations=True, num_checkpoints=3
        )
    assert [getattr(checkpointing, name) for name in names] == [True, False, True, False, True]
    assert checkpointing.num_layers == 3 and checkpointing.mpu is mpu
    assert checkpointing.deepspeed_checkpointing_enabled is True
    checkpointing.reset()
    assert checkpointing.num_layers is None and checkpointing.deepspeed_checkpointing_enabled is False


def test_contiguous_without_a_count_is_an_assertion_naming_the_layers_and_changes_nothing() -> None:
    checkpointing.configure(None, checkpoint_in_cpu=True)
    with pytest.raises(AssertionError, match="needs number_checkpoints, the number of layers checkpointed"):
        checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
    assert checkpointing.CPU_CHECKPOINT and not checkpointing.PARTITION_ACTIVATIONS
    assert not checkpointing.CONTIGUOUS_CHECKPOINTING


def test_non_reentrant_checkpoint_matches_and_supports_autograd_grad() -> None:
    checkpointing.model_parallel_cuda_manual_seed(3)
    blocks, x = _model(use_tracker=True), torch.randn(8, 16)
    states = checkpointing.get_cuda_rng_tracker().get_states()
    plain = _grads(blocks, x, None)
    checkpointing.get_cuda_rng_tracker().set_states(states)
    _assert_identical(plain, _grads(blocks, x, checkpointing.non_reentrant_checkpoint))
    h = torch.randn(2, 16, requires_grad=True)
    (g,) = torch.autograd.grad(checkpointing.non_reentrant_checkpoint(blocks[0], h).sum(), h)
    assert g.shape == h.shape
    with pytest.raises(RuntimeError, match="use .backward"):
        torch.autograd.grad(checkpointing.checkpoint(blocks[0], h).sum(), h)
