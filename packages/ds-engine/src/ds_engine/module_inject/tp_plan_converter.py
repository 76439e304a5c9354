"""`deepspeed.module_inject.tp_plan_converter`: a Hugging Face `tp_plan` as DeepSpeed's `TPLayerSpec` list.

`TPPlanConverter.convert(plan)` is ds-parallel's `plan_to_layer_specs` (`ds_parallel.tensor`): one spec per
entry, None for an empty plan, a `ValueError` naming every unsupported style (the whole plan refused).
`_wildcard_to_regex` is DeepSpeed's private name of `plan_wildcard_regex`. Needs the `parallel` extra:
without ds-parallel, a call raises ImportError naming `pip install 'ds-engine[parallel]'`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ds_engine._optional import require

if TYPE_CHECKING:
    from ds_parallel.tensor import TPLayerSpec

    SUPPORTED_STYLES: frozenset[str]

__all__ = ["SUPPORTED_STYLES", "TPPlanConverter"]


def _tensor() -> Any:
    return require("ds_parallel", extra="parallel", feature="deepspeed.module_inject.tp_plan_converter").tensor


def __getattr__(name: str) -> Any:
    if name == "SUPPORTED_STYLES":  # the plan styles DeepSpeed 0.19.8 converts: ds-parallel's PLAN_STYLES
        return frozenset(_tensor().PLAN_STYLES)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TPPlanConverter:
    """DeepSpeed's converter of a Hugging Face `tp_plan` into regex layer specs."""

    @staticmethod
    def convert(hf_tp_plan: Mapping[str, str]) -> list[TPLayerSpec] | None:
        """One `TPLayerSpec` per entry (None for an empty plan); see `ds_parallel.tensor.plan_to_layer_specs`."""
        specs: list[TPLayerSpec] | None = _tensor().plan_to_layer_specs(hf_tp_plan)
        return specs

    @staticmethod
    def _wildcard_to_regex(pattern: str) -> str:
        regex: str = _tensor().plan_wildcard_regex(pattern)
        return regex
