"""`deepspeed.checkpoint` for migrated scripts, framework integrations and offline tools.

`checkpoint.utils`: `clone_tensors_for_torch_save` (what Accelerate calls before `torch.save` of a
ZeRO-0/1/2 model's state_dict) and the per-rank file names. `checkpoint.constants`: the key and file
names of the checkpoint format. `DeepSpeedCheckpoint`: a saved tag directory (ds's or DeepSpeed's),
its files, layout and states, read without an engine.
"""

from __future__ import annotations

from ds_engine.checkpoint import constants, utils
from ds_engine.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from ds_engine.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint

__all__ = ["UNIVERSAL_CHECKPOINT_INFO", "DeepSpeedCheckpoint", "constants", "utils"]
