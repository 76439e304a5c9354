"""`deepspeed.runtime.tensor_parallel`: AutoTP training's config models and `TpTrainingManager`.

`config` holds `TPConfig`, `TPTrainingConfig` (ds-engine's `tensor_parallel` section models),
`get_tensor_parallel_config` and `AUTOTP_MODE`; `tp_manager` holds `TpTrainingManager`. `AUTOTP_MODE`
and `TpTrainingManager` need the `parallel` extra (ds-parallel) and load on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_engine.runtime.tensor_parallel.config import TPConfig, TPTrainingConfig, get_tensor_parallel_config

if TYPE_CHECKING:  # type checkers see the lazy names
    from ds_engine.runtime.tensor_parallel.config import AUTOTP_MODE as AUTOTP_MODE
    from ds_engine.runtime.tensor_parallel.tp_manager import TpTrainingManager as TpTrainingManager

__all__ = ["AUTOTP_MODE", "TPConfig", "TPTrainingConfig", "TpTrainingManager", "get_tensor_parallel_config"]


def __getattr__(name: str) -> Any:
    if name == "AUTOTP_MODE":
        from ds_engine.runtime.tensor_parallel import config

        return config.AUTOTP_MODE
    if name == "TpTrainingManager":
        from ds_engine.runtime.tensor_parallel.tp_manager import TpTrainingManager

        return TpTrainingManager
    raise AttributeError(f"module 'ds_engine.runtime.tensor_parallel' has no attribute {name!r}")
