"""`deepspeed.module_inject.auto_tp`: `AutoTP`'s static helpers, answered by ds-parallel's AutoTP parser.

DeepSpeed's `AutoTP` class is two things: static helpers that read a model's module tree (which blocks
to shard, which of their linear layers are row-parallel), which scripts and integrations call, and
an instance that DeepSpeed's own `replace_module` drives layer by layer. ds keeps the first, over
`ds_parallel.tensor` (the `parallel` extra): `tp_parser`, `supported`, `get_module_list`,
`in_module_list`, `update_policy_list` and `kernel_supported`. Sharding itself is
`ds_parallel.tensor.shard_model` (what `initialize()` and `TpTrainingManager` call), so constructing an
`AutoTP` instance is refused with that pointer. `AutoTPConfig`, `TPLayerSpec` and `PartitionType` are
importable from here too, as from DeepSpeed's module (ds-parallel's, as in `autotp_config`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from torch import nn

from ds_engine._optional import require

if TYPE_CHECKING:  # looked up at run time (`__getattr__`); type checkers see ds_parallel's own
    from ds_parallel.tensor import AutoTPConfig, PartitionType, TPLayerSpec  # noqa: F401

__all__ = ["AutoTP", "AutoTPConfig", "PartitionType", "TPLayerSpec"]

_CONFIG_NAMES = ("AutoTPConfig", "PartitionType", "TPLayerSpec")


def _tensor() -> Any:
    return require("ds_parallel", extra="parallel", feature="deepspeed.module_inject.auto_tp").tensor


def __getattr__(name: str) -> Any:
    if name in _CONFIG_NAMES:
        return getattr(_tensor(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class AutoTP:
    """DeepSpeed's automatic tensor-parallel policy, as static helpers."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError(
            "AutoTP instances (DeepSpeed's layer-by-layer replacement) are not part of ds: shard a model with "
            "ds_parallel.tensor.shard_model(model, tp_group=...), or let initialize() do it with "
            '"tensor_parallel": {"autotp_size": N}; the static helpers (AutoTP.tp_parser, ...) work'
        )

    @staticmethod
    def in_module_list(module: nn.Module, module_list: Iterable[nn.Module]) -> bool:
        """Whether a module of `module`'s class name is in `module_list`."""
        return any(type(item).__name__ == type(module).__name__ for item in module_list)

    @staticmethod
    def get_module_list(model: nn.Module) -> list[nn.Module]:
        """One instance of every distinct block type held in an `nn.ModuleList` of `model`, in tree order."""
        blocks: list[nn.Module] = _tensor().block_modules(model)
        return blocks

    @staticmethod
    def supported(model: nn.Module) -> bool:
        """False for the model families AutoTP refuses (GPT-2, DeBERTa, ...), True otherwise."""
        tensor = _tensor()
        return tensor.model_family(model) not in tensor.UNSUPPORTED_FAMILIES

    @staticmethod
    def update_policy_list(
        policy_list: list[tuple[type[nn.Module], Any]], new_module: nn.Module, new_gems: Iterable[str]
    ) -> list[tuple[type[nn.Module], Any]]:
        """Add `(type(new_module), new_gems)` to `policy_list` (in place), merging the names of a type already there."""
        for i, (block_type, gems) in enumerate(policy_list):
            if block_type is type(new_module):
                policy_list[i] = (block_type, set(new_gems) | set(gems))
                return policy_list
        policy_list.append((type(new_module), list(new_gems)))
        return policy_list

    @staticmethod
    def kernel_supported(module_list: Iterable[nn.Module]) -> bool:
        """Whether a kernel-injection policy covers one of the modules: never in ds (no kernel injection)."""
        return False

    @staticmethod
    def tp_parser(model: nn.Module) -> list[tuple[type[nn.Module], list[str]]]:
        """Per block type, the names of its row-parallel linear layers (`.o_proj`, `mlp.down_proj`, ...).

        Raises:
            ValueError: the model's family is refused, or no block has a layer that ends a
                tensor-parallel region (DeepSpeed asserts in both cases).
        """
        return [(p.block_type, sorted(p.row_parallel)) for p in _tensor().find_block_policies(model)]
