"""ZeRO-3 leaf modules: a module whose whole subtree is gathered at once when it is entered.

Stage 3 gathers each module's parameters right before it runs, so every rank must run the same modules
in the same order. A mixture-of-experts block breaks that: which experts run depends on the data, so
rank 0 may enter expert 0 while rank 1 enters expert 1, and their gathers no longer pair up (ds reports
`GatherDivergenceError`). Marking the block as a *leaf* makes its gather unit cover every parameter of
its subtree: all of them are gathered when the block is entered and released when it is left, and its
submodules gather nothing of their own, so what they do inside differs freely across ranks. The cost is
memory: the whole subtree is resident while the block runs.

DeepSpeed's API and attribute names: the flag is `module._z3_leaf`; each parameter of a leaf's subtree
gets `param.ds_z3_leaf_module` (the leaf) when a model is put under stage-3 management. Flags must be
set before that (before `initialize` / `DeepSpeedZeroOptimizer_Stage3` / `DeepSpeedZeRoOffload`); a flag
changed afterwards takes effect only for a model managed again.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from ds_zero.config import LeafModuleConfig

logger = logging.getLogger(__name__)

__all__ = [
    "apply_leaf_module_config",
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
]


def z3_leaf_module(model: nn.Module) -> bool:
    """Whether `model` is flagged as a ZeRO-3 leaf module."""
    return bool(getattr(model, "_z3_leaf", False))


def z3_leaf_parameter(model: nn.Parameter) -> bool:
    """Whether the parameter belongs to the subtree of a leaf module of a stage-3 managed model."""
    return hasattr(model, "ds_z3_leaf_module")


def get_z3_leaf_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of `model` (itself included) flagged as leaves, in `modules()` order."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def set_z3_leaf_module(model: nn.Module, flag: bool) -> None:
    """Set or clear the leaf flag of one module."""
    _warn_if_managed(model)
    model._z3_leaf = flag


def _class_matches(module: nn.Module, spec: type | str) -> bool:
    if isinstance(spec, type):
        return isinstance(module, spec)
    cls = type(module)
    return spec in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}")


def _set_by_class(
    model: nn.Module, classes: Sequence[type | str], flag: bool, raise_if_not_found: bool
) -> list[nn.Module]:
    if isinstance(classes, (str, type)) or not all(isinstance(c, (type, str)) for c in classes):
        raise TypeError(f"leaf_module_classes must be a list of module classes or class names, got {classes!r}")
    matched = [m for m in model.modules() if any(_class_matches(m, c) for c in classes)]
    if not matched and raise_if_not_found:
        raise ValueError(f"no modules of type {list(classes)} found in model {type(model).__name__}")
    for m in matched:
        set_z3_leaf_module(m, flag)
    return matched


def set_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Flag every module of `model` that is an instance of one of `leaf_module_classes` as a leaf.

    Args:
        model: the model.
        leaf_module_classes: classes, or class names (`"MixtralSparseMoeBlock"` or the qualified
            `"transformers.models.mixtral.modeling_mixtral.MixtralSparseMoeBlock"`).
        raise_if_not_found: raise ValueError when nothing matches.

    Returns:
        The flagged modules.
    """
    return _set_by_class(model, leaf_module_classes, True, raise_if_not_found)


def unset_z3_leaf_modules(
    model: nn.Module, leaf_module_classes: Sequence[type | str], raise_if_not_found: bool = True
) -> list[nn.Module]:
    """Clear the leaf flag of every module of `model` of one of `leaf_module_classes` (see `set_z3_leaf_modules`)."""
    return _set_by_class(model, leaf_module_classes, False, raise_if_not_found)


def set_z3_leaf_modules_by_name(
    model: nn.Module, module_names: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag of the modules named `module_names` (as in `named_modules()`).

    Returns:
        (the modules found, the names that matched nothing).

    Raises:
        ValueError: some name matched nothing and `raise_if_not_found`.
    """
    by_name = dict(model.named_modules())
    found, missing = [], []
    for name in module_names:
        module = by_name.get(name)
        if module is None:
            missing.append(name)
            continue
        set_z3_leaf_module(module, flag)
        found.append(module)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules named {missing} in model {type(model).__name__}")
    return found, missing


def set_z3_leaf_modules_by_suffix(
    model: nn.Module, module_name_suffixes: Sequence[str], flag: bool = True, raise_if_not_found: bool = True
) -> tuple[list[nn.Module], list[str]]:
    """Set the leaf flag of every module whose `named_modules()` name ends with one of `module_name_suffixes`.

    Returns:
        (the modules found, each once; the suffixes that matched nothing).

    Raises:
        ValueError: some suffix matched nothing and `raise_if_not_found`.
    """
    named = list(model.named_modules())
    found: list[nn.Module] = []
    seen: set[int] = set()
    missing = []
    for suffix in module_name_suffixes:
        hits = [m for name, m in named if name.endswith(suffix)]
        if not hits:
            missing.append(suffix)
        for m in hits:
            set_z3_leaf_module(m, flag)
            if id(m) not in seen:
                seen.add(id(m))
                found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"no modules with a name ending in {missing} in model {type(model).__name__}")
    return found, missing


def apply_leaf_module_config(model: nn.Module, config: LeafModuleConfig | None) -> list[nn.Module]:
    """Flag the modules the `zero_optimization.leaf_module` section names; returns them (each once).

    Classes, names and suffixes that match nothing are not an error (the default class list names
    Hugging Face MoE blocks most models do not have); non-default entries that match nothing are logged.
    """
    if config is None:
        return []
    found: dict[int, nn.Module] = {}
    for m in set_z3_leaf_modules(model, config.classes, raise_if_not_found=False) if config.classes else []:
        found.setdefault(id(m), m)
    named, missing_names = set_z3_leaf_modules_by_name(model, config.names, raise_if_not_found=False)
    suffixed, missing_suffixes = set_z3_leaf_modules_by_suffix(model, config.name_suffixes, raise_if_not_found=False)
    for m in [*named, *suffixed]:
        found.setdefault(id(m), m)
    if missing_names or missing_suffixes:
        logger.warning(
            "zero_optimization.leaf_module: no module matches names %s / name_suffixes %s",
            missing_names,
            missing_suffixes,
        )
    if found:
        logger.info("ZeRO-3 leaf modules: %s", sorted({type(m).__name__ for m in found.values()}))
    return list(found.values())


def _warn_if_managed(module: nn.Module) -> None:
    for p in module.parameters():
        state = getattr(p, "_ds_state", None)
        if state is not None and state.coord is not None:
            logger.warning(
                "leaf flag of %s changed after its model was put under ZeRO-3 management: it takes effect "
                "only when the model is managed again; set leaf modules before initialize()",
                type(module).__name__,
            )
            return
