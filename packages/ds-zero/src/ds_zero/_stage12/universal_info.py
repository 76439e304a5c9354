"""The `universal_checkpoint_info` a client put on its parameters, read once at construction.

Megatron-style clients describe how their tensor-parallel parameters are cut by setting
`universal_checkpoint_info` on the parameters; DeepSpeed's ZeRO optimizer takes the first one it finds
(one per model: every parameter carries the same dict) when it is built, and saves it in its state dict
under the same key, so a universal conversion can read it. `bit16_groups` (DeepSpeed's name) are the
model parameters of each param group the optimizer was built over.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["UNIVERSAL_INFO_KEY", "UniversalInfoCache"]

UNIVERSAL_INFO_KEY = "universal_checkpoint_info"


class UniversalInfoCache:
    """Mixin: `_enable_universal_checkpoint()` caches the info of `self.bit16_groups`' parameters."""

    bit16_groups: list[list[torch.Tensor]]

    def _enable_universal_checkpoint(self) -> None:
        """Cache the first `universal_checkpoint_info` found on a parameter (None when none has one)."""
        self._universal_checkpoint_info = next(
            (
                info
                for group in self.bit16_groups
                for p in group
                if (info := getattr(p, UNIVERSAL_INFO_KEY, None)) is not None
            ),
            None,
        )

    def _get_universal_checkpoint_info(self) -> dict[str, Any] | None:
        """The cached `universal_checkpoint_info`, read at construction (None when no parameter had one)."""
        return getattr(self, "_universal_checkpoint_info", None)
