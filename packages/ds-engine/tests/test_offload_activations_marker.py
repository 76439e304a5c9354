"""The Hugging Face layer marker of `CheckpointHiddenStatesOffload`: installed while a context is active only.

Covers restoration on exit and on exception, nesting, re-entry, thread locality, a marker the
user installed, and a missing or too-old transformers.
"""

from __future__ import annotations

import importlib.machinery
import logging
import sys
import threading
import types
from functools import partial

import pytest
import torch
from host_as_device import HostAsDevice
from torch.utils.checkpoint import checkpoint

from ds_engine._activation_offload import hf_marker as _hf_marker
from ds_engine.runtime.activation_checkpointing.offload_activations import (
    CheckpointHiddenStatesOffload,
    patch_gradient_checkpointing_layer_marker,
)

tf = pytest.importorskip("transformers")
if not hasattr(tf, "GradientCheckpointingLayer"):
    pytest.skip("transformers without GradientCheckpointingLayer (< 4.52)", allow_module_level=True)
Layer = tf.GradientCheckpointingLayer


class _Square(Layer):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.cos() * hidden_states


def _layer(checkpointing: bool = True) -> _Square:
    layer = _Square()
    layer.gradient_checkpointing = checkpointing
    layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    return layer.train()


def _offload(**kwargs: object) -> CheckpointHiddenStatesOffload:
    return CheckpointHiddenStatesOffload(
        use_streams=False, min_offload_bytes=0, keep_last_count=0, accelerator=HostAsDevice(), **kwargs
    )


@pytest.fixture(autouse=True)
def _no_marker_left() -> None:
    original = Layer.__dict__.get("__call__")
    yield
    assert Layer.__dict__.get("__call__") is original


def test_marker_only_while_active() -> None:
    original = Layer.__call__
    offload, layer = _offload(), _layer()
    x = torch.randn(3, 5, requires_grad=True)
    with offload:
        assert Layer.__call__ is not original
        layer(x).sum().backward()
    assert Layer.__call__ is original
    assert offload.stats.marked_tensors == offload.stats.offloaded_tensors == offload.stats.restored_tensors == 1
    ref = x.grad.clone()
    x.grad = None
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, ref, rtol=0, atol=0)
    assert offload.stats.marked_tensors == 1


def test_marker_removed_on_exception() -> None:
    original = Layer.__call__
    offload = _offload()
    with pytest.raises(KeyError, match="in forward"):
        with offload:
            raise KeyError("in forward")
    assert Layer.__call__ is original
    assert _hf_marker.current_manager() is None
    with offload:  # usable again
        _layer()(torch.randn(3, 5, requires_grad=True)).sum().backward()
    assert offload.stats.offloaded_tensors == 1


def test_nested_contexts_share_the_marker_and_the_innermost_marks() -> None:
    original = Layer.__call__
    outer, inner = _offload(), _offload()
    with outer:
        patched = Layer.__call__
        with inner:
            assert Layer.__call__ is patched
            _layer()(torch.randn(3, 5, requires_grad=True)).sum().backward()
        assert Layer.__call__ is patched
    assert Layer.__call__ is original
    assert inner.stats.marked_tensors == 1 and outer.stats.marked_tensors == 0


def test_reentry_is_refused_and_changes_nothing() -> None:
    offload = _offload()
    with offload:
        patched = Layer.__call__
        with pytest.raises(RuntimeError, match="not re-entrant"):
            offload.__enter__()
        assert Layer.__call__ is patched and _hf_marker.current_manager() is offload
        _layer()(torch.randn(3, 5, requires_grad=True)).sum().backward()
    assert offload.stats.offloaded_tensors == 1


def test_layers_without_checkpointing_are_not_marked() -> None:
    offload = _offload()
    with offload:
        _layer(checkpointing=False)(torch.randn(3, 5, requires_grad=True)).sum().backward()
        _layer()(hidden_states=torch.randn(3, 5, requires_grad=True)).sum().backward()  # keyword: never saved
    assert offload.stats.marked_tensors == 0 and not offload._allowed


def test_other_threads_are_not_marked() -> None:
    offload = _offload()
    with offload:
        worker = threading.Thread(target=lambda: _layer()(torch.randn(3, 5, requires_grad=True)).sum().backward())
        worker.start()
        worker.join(timeout=60)
    assert offload.stats.marked_tensors == 0


def test_user_installed_marker_outlives_contexts() -> None:
    original = Layer.__dict__.get("__call__")
    patch_gradient_checkpointing_layer_marker()
    try:
        patched = Layer.__call__
        with _offload():
            assert Layer.__call__ is patched
        assert Layer.__call__ is patched
        _layer()(torch.randn(3, 5, requires_grad=True))  # no context: plain call
    finally:
        _hf_marker._unpatch()
    assert Layer.__dict__.get("__call__") is original


def test_without_transformers_marks_are_manual(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install 'transformers>=4.52'"):
        patch_gradient_checkpointing_layer_marker()
    x = torch.randn(3, 5, requires_grad=True)
    offload = _offload()
    with offload:
        offload.mark(x)
        checkpoint(torch.sin, x, use_reentrant=False).sum().backward()
    assert offload.stats.offloaded_tensors == 1
    torch.testing.assert_close(x.grad, x.detach().cos(), rtol=0, atol=0)


def test_too_old_transformers_warns_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    old = types.ModuleType("transformers")
    old.__spec__ = importlib.machinery.ModuleSpec("transformers", None)
    monkeypatch.setitem(sys.modules, "transformers", old)
    _hf_marker._warn_once_old_transformers.cache_clear()
    with caplog.at_level(logging.WARNING, logger=_hf_marker.__name__):
        for _ in range(2):
            with _offload():
                pass
    assert [r.getMessage() for r in caplog.records].count(
        "activation offload marks no layer automatically: " + _hf_marker._TRANSFORMERS_NEEDED
    ) == 1
