"""The refusal of an enabled `zero_optimization.zenflow` section by the ZeRO optimizers (ds runs no ZenFlow loop).

Kept apart from `ZenFlowConfig` so the optimizers can check without importing pydantic at import time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NOT_IMPLEMENTED", "refuse_zenflow"]

#: Why a ZenFlow section is refused where a training loop would need it (the key path goes in front).
NOT_IMPLEMENTED = (
    "ZenFlow's training loop (selective updates on the accelerator with the overlapped CPU update) is not "
    "implemented in ds; remove the section or set it to null. The selective optimizers can be used on "
    "their own: ds_ops.ZenFlowSelectiveAdamW / ZenFlowSelectiveAdamW_stage3 (deepspeed.ops.adam)"
)


def refuse_zenflow(config: Any) -> None:
    """Raise ValueError when the `zero_optimization` model `config` enables ZenFlow (present, not null).

    Raises:
        ValueError: naming `zero_optimization.zenflow` and saying what is missing.
    """
    if getattr(config, "zenflow", None) is not None:
        raise ValueError(f"zero_optimization.zenflow: {NOT_IMPLEMENTED}")
