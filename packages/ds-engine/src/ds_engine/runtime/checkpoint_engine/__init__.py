"""`deepspeed.runtime.checkpoint_engine`: the object that writes and reads checkpoint files by path.

`engine.checkpoint_engine` is a `TorchCheckpointEngine` (a `FastCheckpointEngine` with `checkpoint.writer`);
scripts (Megatron-DeepSpeed and others) save their own files through it so they follow the engine's
serialization and writer settings.
"""

from __future__ import annotations

from ds_engine.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from ds_engine.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
from ds_engine.runtime.checkpoint_engine.torch_checkpoint_engine import CheckpointCommitInfo, TorchCheckpointEngine

__all__ = ["CheckpointCommitInfo", "CheckpointEngine", "FastCheckpointEngine", "TorchCheckpointEngine"]
