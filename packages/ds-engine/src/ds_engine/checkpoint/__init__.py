"""`deepspeed.checkpoint` for migrated scripts, framework integrations and offline tools.

`checkpoint.utils`: `clone_tensors_for_torch_save` (what Accelerate calls before `torch.save` of a
ZeRO-0/1/2 model's state_dict) and the per-rank file names. `checkpoint.constants`: the key and file
names of the checkpoint format. `DeepSpeedCheckpoint`: a saved tag directory (ds's or DeepSpeed's),
its files, layout and states, read without an engine. `get_model_3d_descriptor(dir)`: a tag
directory's pp/tp/dp degrees as a `model_3d_desc`, whose `reshape(target)` maps the source ranks onto
a smaller layout (`reshape_meg_2d_parallel` for the pp x tp part); `ZeROCheckpoint`: a tag
directory's optimizer-state files by (target) rank, merged on request (`merge_state`).
"""

from __future__ import annotations

from ds_engine.checkpoint import constants, utils
from ds_engine.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO
from ds_engine.checkpoint.deepspeed_checkpoint import DeepSpeedCheckpoint
from ds_engine.checkpoint.reshape_3d_utils import CheckpointLayoutError, get_model_3d_descriptor, model_3d_desc
from ds_engine.checkpoint.reshape_meg_2d import reshape_meg_2d_parallel
from ds_engine.checkpoint.reshape_utils import merge_state
from ds_engine.checkpoint.utils import get_model_ckpt_name_for_rank, get_zero_ckpt_name_for_rank
from ds_engine.checkpoint.zero_checkpoint import ZeROCheckpoint

__all__ = [
    "UNIVERSAL_CHECKPOINT_INFO",
    "CheckpointLayoutError",
    "DeepSpeedCheckpoint",
    "ZeROCheckpoint",
    "constants",
    "get_model_3d_descriptor",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
    "merge_state",
    "model_3d_desc",
    "reshape_meg_2d_parallel",
    "utils",
]
