"""Marks the input of each Hugging Face checkpointed layer for the active offload context.

[Note: why patch `__call__`]
Under non-reentrant checkpointing the only tensors a checkpointed layer leaves for backward
are its positional inputs, saved once before the recomputable region; everything else is
recomputed. Hugging Face routes every such layer through `GradientCheckpointingLayer`, so
wrapping that class's `__call__` while an offload context is active tells the context which
saved tensor is "the hidden states entering a checkpointed layer" (`args[0]`). The wrapper is
installed by the first context that needs it and removed when the last one exits, so a model
outside any context (or reused by the hybrid engine) runs the class's own code.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ds_engine._activation_offload.offload_activations import CheckpointHiddenStatesOffload

__all__ = [
    "acquire_marker",
    "current_manager",
    "patch_gradient_checkpointing_layer_marker",
    "pop_manager",
    "push_manager",
    "release_marker",
]

_TRANSFORMERS_NEEDED = (
    "marking Hugging Face checkpointed layers for activation offload needs transformers >= 4.52 "
    "(GradientCheckpointingLayer): pip install 'transformers>=4.52'"
)

logger = logging.getLogger(__name__)
_local = threading.local()
_lock = threading.Lock()
# The class's own `__call__` (None: inherited from nn.Module) and the wrapper that replaced it.
_original_call: Callable[..., Any] | None = None
_wrapper: Callable[..., Any] | None = None
_installed_by_context = False
_num_users = 0


def _stack() -> list[CheckpointHiddenStatesOffload]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def current_manager() -> CheckpointHiddenStatesOffload | None:
    """The innermost offload context active on this thread, if any."""
    stack = _stack()
    return stack[-1] if stack else None


def push_manager(manager: CheckpointHiddenStatesOffload) -> None:
    """Make `manager` the innermost context on this thread; refuses one already active."""
    if manager in _stack():
        raise RuntimeError(
            "CheckpointHiddenStatesOffload is not re-entrant: this instance is already active; "
            "use a separate instance for a nested context"
        )
    _stack().append(manager)


def pop_manager(manager: CheckpointHiddenStatesOffload) -> None:
    """Remove `manager` from this thread's contexts (wherever it is, should exits interleave)."""
    stack = _stack()
    if manager in stack:
        stack.remove(manager)


def _gradient_checkpointing_layer() -> type[torch.nn.Module]:
    try:
        from transformers import GradientCheckpointingLayer
    except ImportError as err:
        raise ImportError(_TRANSFORMERS_NEEDED) from err
    return GradientCheckpointingLayer


def patch_gradient_checkpointing_layer_marker() -> None:
    """Wrap `transformers.GradientCheckpointingLayer.__call__` to mark `args[0]` (idempotent).

    Installed this way (rather than by a context), the wrapper stays until the process ends;
    it marks only while an offload context is active on the calling thread.

    Raises:
        ImportError: transformers (>= 4.52) is not installed; the message says what to install.
    """
    global _original_call, _wrapper
    if _wrapper is not None:
        return
    layer_cls = _gradient_checkpointing_layer()
    original = layer_cls.__dict__.get("__call__")
    inherited_call = layer_cls.__call__

    def _marking_call(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        manager = current_manager()
        marked: torch.Tensor | None = None
        if (
            manager is not None
            and self.training
            and torch.is_grad_enabled()
            and getattr(self, "gradient_checkpointing", False)
            and args
            and torch.is_tensor(args[0])
        ):
            # Only positional inputs reach the checkpoint's saved tensors; a keyword
            # hidden_states is bound into a partial and never packed.
            marked = args[0]
            manager.mark(marked)
        try:
            return inherited_call(self, *args, **kwargs)
        finally:
            if manager is not None and marked is not None:
                # Marks are keyed by id(), which Python reuses: never leave one behind.
                manager._consume_mark(marked)

    layer_cls.__call__ = _marking_call  # type: ignore[method-assign]
    _original_call, _wrapper = original, _marking_call


def _unpatch() -> None:
    global _original_call, _wrapper
    wrapper, original = _wrapper, _original_call
    _wrapper = _original_call = None
    if wrapper is None:
        return
    layer_cls = _gradient_checkpointing_layer()
    if layer_cls.__dict__.get("__call__") is not wrapper:
        return  # someone patched over us; theirs stays
    if original is None:
        delattr(layer_cls, "__call__")
    else:
        layer_cls.__call__ = original  # type: ignore[method-assign]


def acquire_marker() -> bool:
    """Count one more active context, installing the wrapper if transformers is importable.

    Returns whether the context was counted (pass it to `release_marker`). With a transformers
    too old for `GradientCheckpointingLayer`, nothing can be marked automatically: that is
    said once, and explicit `mark()` calls still work.
    """
    global _installed_by_context, _num_users
    with _lock:
        if _wrapper is None and importlib.util.find_spec("transformers") is not None:
            try:
                patch_gradient_checkpointing_layer_marker()
                _installed_by_context = True
            except ImportError:
                _warn_once_old_transformers()
        if _wrapper is None:
            return False
        _num_users += 1
        return True


def release_marker(counted: bool) -> None:
    """Undo a counted `acquire_marker`; the last one out removes a wrapper that a context installed."""
    global _installed_by_context, _num_users
    if not counted:
        return
    with _lock:
        _num_users -= 1
        if _num_users == 0 and _installed_by_context:
            _unpatch()
            _installed_by_context = False


@functools.cache
def _warn_once_old_transformers() -> None:
    logger.warning("activation offload marks no layer automatically: %s", _TRANSFORMERS_NEEDED)
