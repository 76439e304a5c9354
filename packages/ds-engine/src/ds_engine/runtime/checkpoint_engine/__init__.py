"""`deepspeed.runtime.checkpoint_engine`: the object that writes and reads checkpoint files by path.

`engine.checkpoint_engine` is a `TorchCheckpointEngine` (a `FastCheckpointEngine` with `checkpoint.writer`,
a `DecoupledCheckpointEngine` with `writer.decoupled`; `create_checkpoint_engine` makes one alone);
scripts (Megatron-DeepSpeed and others) save their own files through it so they follow the engine's
serialization and writer settings.
"""

from __future__ import annotations

from ds_engine.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine
from ds_engine.runtime.checkpoint_engine.decoupled_checkpoint_engine import DecoupledCheckpointEngine
from ds_engine.runtime.checkpoint_engine.fast_checkpoint_engine import FastCheckpointEngine
from ds_engine.runtime.checkpoint_engine.torch_checkpoint_engine import CheckpointCommitInfo, TorchCheckpointEngine
from ds_engine.runtime.checkpoint_engine.utils import create_checkpoint_engine

__all__ = [
    "CheckpointCommitInfo",
    "CheckpointEngine",
    "DecoupledCheckpointEngine",
    "FastCheckpointEngine",
    "TorchCheckpointEngine",
    "create_checkpoint_engine",
]
