"""`deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save`, and the checkpoint file names per rank.

`torch.save` writes a tensor's whole storage, not just the view: a state_dict whose tensors are views
into a flat buffer (ZeRO's contiguous parameters and gradients) would save the buffer once per view.
Cloning first gives each tensor a storage of its own size, on the CPU by default.

`get_model_ckpt_name_for_rank(folder, "00")` and `get_zero_ckpt_name_for_rank(folder, dp_rank, mp_rank)` spell
DeepSpeed's file names, which ds writes too.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = [
    "clone_tensors_for_torch_save",
    "get_model_ckpt_name_for_rank",
    "get_zero_ckpt_name_for_rank",
]

_CPU = torch.device("cpu")


def clone_tensors_for_torch_save(item: Any, device: torch.device | str = _CPU) -> Any:
    """`item` with every tensor replaced by a detached copy on `device`; containers keep their type.

    Dicts (including `OrderedDict`), lists and tuples are walked recursively; anything else is
    returned as is.
    """
    if torch.is_tensor(item):
        return item.detach().clone().to(device)
    if isinstance(item, dict):
        return type(item)((k, clone_tensors_for_torch_save(v, device)) for k, v in item.items())
    if isinstance(item, (list, tuple)):
        return type(item)(clone_tensors_for_torch_save(v, device) for v in item)
    return item


def get_model_ckpt_name_for_rank(base_folder: str, mp_rank_str: str) -> str:
    """`base_folder/mp_rank_{mp_rank_str}_model_states.pt` (`mp_rank_str` is already padded: `"00"`)."""
    return os.path.join(base_folder, f"mp_rank_{mp_rank_str}_model_states.pt")


def get_zero_ckpt_name_for_rank(base_folder: str, dp_rank: int, mp_rank: int) -> str:
    """`base_folder/zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt` (no bf16_ prefix)."""
    return os.path.join(base_folder, f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt")
