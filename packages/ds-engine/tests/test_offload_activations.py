"""Activation offload for checkpointed layers (`offload_activations`), run on CPU through `HostAsDevice`.

Gradients with the context are compared bit for bit with gradients of the same model and data
without it (plain PyTorch checkpointing); the offload's copies are proven to be the data
backward reads by poisoning the device-side originals after forward.
"""

from __future__ import annotations

import contextlib
import math
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from host_as_device import HostAsDevice
from torch import nn

from ds_engine.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload,
    get_checkpoint_hidden_states_offloading_ctx_manager,
)

NUM_LAYERS = 4


def _tiny_llama(seed: int = 0) -> nn.Module:
    tf = pytest.importorskip("transformers")
    if not hasattr(tf, "GradientCheckpointingLayer"):
        pytest.skip("transformers without GradientCheckpointingLayer (< 4.52)")
    config = tf.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()
    _enable_checkpointing(model, use_reentrant=False)
    model.train()
    return model


def _enable_checkpointing(model: nn.Module, *, use_reentrant: bool) -> None:
    # transformers 5 renamed the switch; the old name still works there but warns.
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _batch() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(5))


def _grads(model: nn.Module, ids: torch.Tensor, *, after_forward: Callable[[], None] = lambda: None) -> list:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    after_forward()
    loss.backward()
    return [loss.detach()] + [p.grad.clone() for p in model.parameters()]


def _assert_bitwise(ours: list, ref: list) -> None:
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("use_streams", "max_fwd_stash_count", "keep_last_count"),
    [(False, 0, 0), (False, 0, 1), (False, 0, 2), (True, 0, 0), (True, 0, 1), (True, 2, 1)],
)
def test_llama_gradients_bitwise_equal(use_streams: bool, max_fwd_stash_count: int, keep_last_count: int) -> None:
    model, ids = _tiny_llama(), _batch()
    ref = _grads(model, ids)
    accel = HostAsDevice()
    offload = CheckpointHiddenStatesOffload(
        use_streams=use_streams,
        min_offload_bytes=0,
        max_fwd_stash_count=max_fwd_stash_count,
        keep_last_count=keep_last_count,
        accelerator=accel,
    )
    with offload:
        ours = _grads(model, ids)
    _assert_bitwise(ours, ref)
    moved = NUM_LAYERS - keep_last_count
    assert offload.stats.marked_tensors == NUM_LAYERS
    assert offload.stats.offloaded_tensors == moved
    assert offload.stats.restored_tensors == moved
    assert offload.stats.kept_last_tensors == keep_last_count
    assert offload.stats.saved_tensors_seen > NUM_LAYERS  # the loss head's tensors pass through
    assert len(accel.pinned) == moved  # one pinned host buffer per offloaded input
    if use_streams:
        (side,) = accel.side_streams
        assert side.waited_streams.count(accel.compute) == moved  # each copy waits for compute


def _layer_inputs(model: nn.Module) -> tuple[list[torch.Tensor], list]:
    seen: list[torch.Tensor] = []
    handles = [layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0])) for layer in model.model.layers]
    return seen, handles


@pytest.mark.parametrize("keep_last_count", [0, 1, 2])
def test_backward_reads_the_host_copies(keep_last_count: int) -> None:
    """Poisoning the offloaded originals after forward changes nothing; poisoning a kept one does."""
    model, ids = _tiny_llama(seed=1), _batch()
    ref = _grads(model, ids)
    seen, handles = _layer_inputs(model)
    moved = NUM_LAYERS - keep_last_count

    def poison_offloaded() -> None:
        for h in seen[:moved]:
            h.data.fill_(math.nan)

    offload = CheckpointHiddenStatesOffload(
        use_streams=False, min_offload_bytes=0, keep_last_count=keep_last_count, accelerator=HostAsDevice()
    )
    with offload:
        ours = _grads(model, ids, after_forward=poison_offloaded)
    _assert_bitwise(ours, ref)

    if keep_last_count:
        seen.clear()

        def poison_kept() -> None:
            seen[-1].data.fill_(math.nan)

        with offload:
            poisoned = _grads(model, ids, after_forward=poison_kept)
        assert torch.isnan(torch.cat([g.flatten() for g in poisoned[1:]])).any()
    for handle in handles:
        handle.remove()


def test_llama_reentrant_checkpointing_bitwise_equal() -> None:
    model, ids = _tiny_llama(seed=2), _batch()
    _enable_checkpointing(model, use_reentrant=True)
    ref = _grads(model, ids)
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, keep_last_count=1, accelerator=HostAsDevice())
    with offload:
        ours = _grads(model, ids)
    _assert_bitwise(ours, ref)
    assert offload.stats.offloaded_tensors == NUM_LAYERS - 1


def test_no_marks_in_eval_or_without_grad() -> None:
    model, ids = _tiny_llama(), _batch()
    offload = CheckpointHiddenStatesOffload(min_offload_bytes=0, accelerator=HostAsDevice())
    with offload:
        with torch.no_grad():
            model(input_ids=ids)
        model.eval()
        model(input_ids=ids).logits.sum().backward()
    assert offload.stats.marked_tensors == 0
    assert offload.stats.offloaded_tensors == 0


def test_cpu_accelerator_leaves_tensors_in_place() -> None:
    """On a synchronous device offload would only copy host to host: marked tensors are skipped."""
    model, ids = _tiny_llama(), _batch()
    ref = _grads(model, ids)
    offload = get_checkpoint_hidden_states_offloading_ctx_manager(use_streams=True, min_offload_bytes=0)
    with offload:
        ours = _grads(model, ids)
    _assert_bitwise(ours, ref)
    assert offload.stats.marked_tensors == NUM_LAYERS
    assert offload.stats.skipped_marked_tensors == NUM_LAYERS
    assert offload.stats.offloaded_tensors == 0


def test_import_needs_no_transformers_and_the_deepspeed_path_aliases_it() -> None:
    code = (
        "import sys\n"
        "sys.modules['transformers'] = None\n"  # as if not installed: importing it would fail
        "import ds_engine.runtime.activation_checkpointing as ac\n"
        "m = ac.offload_activations\n"
        "assert m.CheckpointHiddenStatesOffload.__module__ == m.__name__\n"
        "try:\n"
        "    import deepspeed.runtime.activation_checkpointing.offload_activations as d\n"
        "except ModuleNotFoundError as err:\n"
        "    assert err.name == 'deepspeed', err\n"  # the alias distribution is not installed
        "else:\n"
        "    assert d.get_checkpoint_hidden_states_offloading_ctx_manager is "
        "m.get_checkpoint_hidden_states_offloading_ctx_manager\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


def test_engine_training_steps_match_with_offload() -> None:
    """Two AdamW steps of a DeepSpeedEngine with the context around forward+backward: same weights bit for bit."""
    from ds_engine_testkit import base_config, flat_params, make_engine

    ids = torch.randint(0, 64, (4, 12), generator=torch.Generator().manual_seed(9))
    results = []
    for offload in (None, CheckpointHiddenStatesOffload(min_offload_bytes=0, accelerator=HostAsDevice())):
        engine = make_engine(_tiny_llama(seed=3), base_config())
        for _ in range(2):
            with offload if offload is not None else contextlib.nullcontext():
                loss = engine(input_ids=ids, labels=ids).loss
                engine.backward(loss)
            engine.step()
        results.append(flat_params(engine.module))
        if offload is not None:
            assert offload.stats.offloaded_tensors == NUM_LAYERS - 1
    assert torch.equal(results[0], results[1])
