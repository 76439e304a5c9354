"""The refusal of an enabled `zero_optimization.zenflow` section by the ZeRO optimizers that do not run its loop.

Kept apart from `ZenFlowConfig` so the optimizers can check without importing pydantic at import time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["NOT_IMPLEMENTED", "refuse_zenflow"]

#: Why a ZenFlow section is refused where a training loop would need it (the key path goes in front).
NOT_IMPLEMENTED = (
    "this optimizer does not run ZenFlow's loop; build ds_zero.ZenFlowZeroOptimizer (ZeRO stage 1/2) or "
    "ds_zero.ZenFlowZeroOptimizer_Stage3 (stage 3) instead (deepspeed.initialize does when the section is "
    "present), or remove the zenflow section"
)


def refuse_zenflow(config: Any) -> None:
    """Raise ValueError when the `zero_optimization` model `config` enables ZenFlow (present, not null).

    Raises:
        ValueError: naming `zero_optimization.zenflow` and saying what is missing.
    """
    if getattr(config, "zenflow", None) is not None:
        raise ValueError(f"zero_optimization.zenflow: {NOT_IMPLEMENTED}")
