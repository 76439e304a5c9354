"""The engine's full-weights views for framework integrations (Accelerate's and the HF Trainer's `save_model`).

`zero_gather_16bit_weights_on_model_save()` tells a caller whether the full weights may be gathered for
saving; `_zero3_consolidated_16bit_state_dict()` gathers them (one module at a time, assembled on the
CPU of rank 0) under ZeRO stage 3, and `_consolidated_16bit_state_dict()` under stage 3 or tensor
parallelism. All keep DeepSpeed's names: Accelerate's `get_state_dict()` calls them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import ds_comm
from ds_engine._optional import require

if TYPE_CHECKING:
    from torch import nn

    from ds_engine.config import ZeroSettings

__all__ = ["ConsolidatedWeights"]


class ConsolidatedWeights:
    """Mixed into `DeepSpeedEngine`."""

    _zero_settings: ZeroSettings
    module: nn.Module
    _tp: Any
    _moe: Any
    if TYPE_CHECKING:  # the engine's

        def module_state_dict(self, *, exclude_frozen_parameters: bool = False) -> dict[str, Any]: ...

    def _consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The whole state_dict (on the CPU) on global rank 0, None elsewhere, when the weights are split:
        ZeRO stage 3 and/or tensor parallelism (DeepSpeed's name). Collective: every rank must call it.

        Raises:
            ValueError: the weights are whole on every rank (neither stage 3 nor tensor parallelism).
        """
        if self._tp is not None:  # whole over the tensor-parallel ranks (and gathered first at stage 3)
            state = self.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters)
            return {k: v.detach().cpu() for k, v in state.items()} if ds_comm.get_rank() == 0 else None
        if self._zero_settings.stage == 3:
            return self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        raise ValueError(
            "_consolidated_16bit_state_dict() applies when the weights are split (ZeRO stage 3 or "
            "tensor_parallel.autotp_size > 1); here module_state_dict() is already whole"
        )

    def _has_autoep_layers(self) -> bool:
        """Whether the model holds AutoEP layers (DeepSpeed's name)."""
        moe = getattr(self, "_moe", None)
        return moe is not None and any(layer.fused_experts for layer in moe.layers)

    def _raise_if_autoep_zero3_consolidated_export(self, operation: str) -> None:
        """Refuse a data-parallel consolidation of AutoEP experts at ZeRO stage 3, as DeepSpeed does.

        Raises:
            NotImplementedError: ZeRO stage 3 with AutoEP layers (their experts are partitioned over their
                expert-data-parallel groups; a gather over data-parallel ranks holds only this rank's experts).
        """
        if self.zero_optimization_partition_weights() and self._has_autoep_layers():
            raise NotImplementedError(
                f"{operation} is not supported for AutoEP with ZeRO Stage 3, as in DeepSpeed: the expert parameters "
                "are partitioned over their expert-data-parallel groups, so a data-parallel consolidation would "
                "hold incomplete expert tensors. Convert a save_checkpoint() with ds_to_universal.py (the "
                "ds_to_universal command; it joins every expert tensor whole), as DeepSpeed advises; "
                "engine.load_checkpoint loads the save as it is at any world size and autoep_size"
            )

    if TYPE_CHECKING:

        def zero_optimization_partition_weights(self) -> bool: ...

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """`zero_optimization.stage3_gather_16bit_weights_on_model_save`: may the full weights be gathered to save?"""
        return bool(self._zero_settings.gather_16bit_weights_on_model_save)

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict[str, Any] | None:
        """The full state_dict of the stage-3 model (parameters in the training dtype, on the CPU) on global rank 0.

        Collective: every rank must call it. Other ranks get None, as in DeepSpeed. Gathers one
        module's parameters at a time (`ds_zero.consolidated_16bit_state_dict`).

        Raises:
            ValueError: the engine is not at ZeRO stage 3 (use `module_state_dict()`).
            NotImplementedError: AutoEP layers (`_raise_if_autoep_zero3_consolidated_export`).
        """
        if self._zero_settings.stage != 3:
            raise ValueError(
                f"_zero3_consolidated_16bit_state_dict() needs ZeRO stage 3 (this engine is at stage "
                f"{self._zero_settings.stage}); the module's own state_dict() is already complete"
            )
        self._raise_if_autoep_zero3_consolidated_export("_zero3_consolidated_16bit_state_dict")
        ds_zero = require("ds_zero", extra="zero", feature="ZeRO stage 3 consolidated state_dict")
        state = ds_zero.consolidated_16bit_state_dict(
            self.module, rank0_only=True, exclude_frozen_parameters=exclude_frozen_parameters
        )
        return state if ds_comm.get_rank() == 0 else None
