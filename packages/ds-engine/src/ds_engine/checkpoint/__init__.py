"""`deepspeed.checkpoint` for migrated scripts and framework integrations: `checkpoint.utils`.

`ds_engine.checkpoint.utils.clone_tensors_for_torch_save` is what Accelerate calls before `torch.save` of
a ZeRO-0/1/2 model's state_dict.
"""

from __future__ import annotations

from ds_engine.checkpoint import utils

__all__ = ["utils"]
