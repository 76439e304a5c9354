"""`deepspeed.runtime.activation_checkpointing.offload_activations`: offload checkpointed-layer inputs to host.

With activation checkpointing, what a layer keeps for backward is its input; over many
layers those inputs are most of the activation memory left. `CheckpointHiddenStatesOffload`
is a `torch.autograd.graph.saved_tensors_hooks` context that sends exactly those inputs to
host buffers during forward and brings each back when backward reaches its layer::

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with CheckpointHiddenStatesOffload():
        loss = model(**batch).loss
        loss.backward()

Inputs are "marked": Hugging Face layers (`transformers.GradientCheckpointingLayer`) mark
their hidden states themselves while a context is active (the class's `__call__` is wrapped
for that time), other code calls `mark(tensor)` before the checkpointed call. Every other
saved tensor passes through untouched. transformers is optional: it is imported only when
installed, to install that wrapper.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from ds_comm import Accelerator
from ds_engine._activation_offload.hf_marker import (
    acquire_marker,
    current_manager,
    patch_gradient_checkpointing_layer_marker,
    pop_manager,
    push_manager,
    release_marker,
)
from ds_engine._activation_offload.offload_engine import (
    ActivationOffloadEngine,
    CheckpointActivationOffloadStats,
    OffloadedTensorRef,
)

__all__ = [
    "CheckpointActivationOffloadStats",
    "CheckpointHiddenStatesOffload",
    "get_checkpoint_hidden_states_offloading_ctx_manager",
    "patch_gradient_checkpointing_layer_marker",
]

# DeepSpeed's private names, for code that imports them from this path.
_ActivationOffloadEngine = ActivationOffloadEngine
_OffloadedTensorRef = OffloadedTensorRef
_current_manager = current_manager


class CheckpointHiddenStatesOffload(ActivationOffloadEngine, saved_tensors_hooks):
    """Saved-tensor hooks that offload marked tensors (checkpointed-layer inputs) to host.

    On entry: the stats and any state of a previous use are reset, the Hugging Face marker is
    installed if transformers is importable, and the hooks become active on this thread.
    During forward, a saved tensor that was marked is handed to the offload engine
    (`ActivationOffloadEngine`: the newest `keep_last_count` stay on the device, older ones are
    copied to pooled, optionally pinned host buffers, on a side stream when `use_streams`);
    autograd keeps a reference token instead. During backward each token is turned back into
    a device tensor with the original size and strides (repeated unpacks of one token, as with
    `retain_graph=True`, return the same tensor). On exit, also by exception: copies in flight
    are waited for, host buffers return to the pool, the marker is removed by the last
    context out and the hooks are popped. Backward must run inside the context.

    Marked tensors stay where they are when the accelerator runs synchronously (CPU), when
    they are not on the accelerator, smaller than `min_offload_bytes`, parameters or buffers,
    or views whose elements may overlap.

    Args: as `ActivationOffloadEngine` (`use_pin_memory`, `use_streams`, `min_offload_bytes`,
    `max_fwd_stash_count`, `max_cpu_buffer_pool_count`, `keep_last_count`, `accelerator`).

    Raises:
        ValueError: a negative count or size.
        RuntimeError: entering an instance that is already active.
    """

    def __init__(
        self,
        use_pin_memory: bool = True,
        use_streams: bool = True,
        min_offload_bytes: int = 1024,
        max_fwd_stash_count: int = 2,
        max_cpu_buffer_pool_count: int = 64,
        keep_last_count: int = 1,
        *,
        accelerator: Accelerator | None = None,
    ) -> None:
        ActivationOffloadEngine.__init__(
            self,
            use_pin_memory=use_pin_memory,
            use_streams=use_streams,
            min_offload_bytes=min_offload_bytes,
            max_fwd_stash_count=max_fwd_stash_count,
            max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
            keep_last_count=keep_last_count,
            accelerator=accelerator,
        )
        # id(tensor) -> pending marks; a tensor passed to two checkpointed calls is marked twice.
        self._allowed: dict[int, int] = {}
        self._marker_counted = False
        saved_tensors_hooks.__init__(self, self._pack_tensor, self._unpack_tensor)

    def mark(self, tensor: torch.Tensor) -> None:
        """Offload `tensor` the next time autograd saves it (once per call)."""
        self._allowed[id(tensor)] = self._allowed.get(id(tensor), 0) + 1
        self.stats.marked_tensors += 1

    def _consume_mark(self, tensor: torch.Tensor) -> bool:
        key = id(tensor)
        count = self._allowed.get(key, 0)
        if count == 0:
            return False
        if count == 1:
            del self._allowed[key]
        else:
            self._allowed[key] = count - 1
        return True

    def _pack_tensor(self, tensor: torch.Tensor) -> Any:
        self.stats.saved_tensors_seen += 1
        if not self._consume_mark(tensor):
            return tensor
        tensor_id = self.offload_input(tensor)
        return tensor if tensor_id is None else OffloadedTensorRef(tensor_id)

    def _unpack_tensor(self, packed: Any) -> Any:
        if isinstance(packed, OffloadedTensorRef):
            return self._restore_tensor(packed.tensor_id, cache=True)
        return packed

    def reset(self) -> None:
        super().reset()
        self._allowed.clear()

    def _sync_and_clear(self) -> None:
        super()._sync_and_clear()
        self._allowed.clear()

    def __enter__(self) -> None:
        push_manager(self)  # refuses re-entry before anything changes
        try:
            self._marker_counted = acquire_marker()
            self.reset()
            super().__enter__()
        except BaseException:
            self._leave()
            raise

    def _leave(self) -> None:
        pop_manager(self)
        counted, self._marker_counted = self._marker_counted, False
        release_marker(counted)

    def __exit__(self, *args: object) -> None:
        try:
            self._sync_and_clear()
        finally:
            try:
                self._leave()
            finally:
                super().__exit__(*args)


def get_checkpoint_hidden_states_offloading_ctx_manager(
    use_pin_memory: bool = True,
    use_streams: bool = True,
    min_offload_bytes: int = 1024,
    max_fwd_stash_count: int = 2,
    max_cpu_buffer_pool_count: int = 64,
    keep_last_count: int = 1,
) -> CheckpointHiddenStatesOffload:
    """A new `CheckpointHiddenStatesOffload` with these settings (DeepSpeed's factory)."""
    return CheckpointHiddenStatesOffload(
        use_pin_memory=use_pin_memory,
        use_streams=use_streams,
        min_offload_bytes=min_offload_bytes,
        max_fwd_stash_count=max_fwd_stash_count,
        max_cpu_buffer_pool_count=max_cpu_buffer_pool_count,
        keep_last_count=keep_last_count,
    )
