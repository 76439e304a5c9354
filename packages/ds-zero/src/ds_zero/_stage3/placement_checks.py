"""What the stage-3 optimizer checks and sets up for placement families (AutoEP experts; `_params.placement`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ds_zero._params.partitioned_param import is_zero_param, state_of
from ds_zero._params.placement import has_families

__all__ = ["refuse_families", "rename_for_checkpoint"]


def refuse_families(params: list[nn.Parameter], optimizer: torch.optim.Optimizer, mp_group: Any) -> None:
    """Refuse what would mix an expert family's shards with the data-parallel ones.

    Muon gathers each matrix's gradient over the data-parallel group, and a tensor-parallel group would
    count expert shards in its norm as if they were cut weights; neither knows placement families.

    Raises:
        ValueError: AutoEP expert parameters with Muon param groups or with tensor parallelism.
    """
    if not has_families(params):
        return
    if any(g.get("use_muon", False) for g in optimizer.param_groups):
        raise ValueError(
            "AutoEP at ZeRO stage 3 (expert_parallel.enabled) with Muon param groups (use_muon=True) is not "
            "supported in ds: the Muon update gathers matrices over the data-parallel group, not the experts' "
            "expert-data-parallel group; use another optimizer"
        )
    if mp_group is not None:
        raise ValueError(
            "AutoEP at ZeRO stage 3 (expert_parallel.enabled) does not support AutoTP "
            "(tensor_parallel.autotp_size > 1), as in DeepSpeed 0.19.8"
        )


def rename_for_checkpoint(module: nn.Module, names: Mapping[str, str] | None) -> None:
    """Save each parameter of `module` named in `names` under its mapped name (its fragments' name).

    Runs after the coordinator named the parameters and took their gather fingerprints from those names,
    so every expert-parallel rank still fingerprints the same gathers.
    """
    if not names:
        return
    for name, p in module.named_parameters():
        if is_zero_param(p) and name in names:
            state_of(p).name = names[name]
