"""`deepspeed.checkpoint.utils`: `clone_tensors_for_torch_save`.

`torch.save` writes a tensor's whole storage, not just the view: a state_dict whose tensors are views
into a flat buffer (ZeRO's contiguous parameters and gradients) would save the buffer once per view.
Cloning first gives each tensor a storage of its own size, on the CPU by default.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["clone_tensors_for_torch_save"]

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
