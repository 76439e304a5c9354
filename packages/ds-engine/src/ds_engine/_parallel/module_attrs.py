"""Reach or replace a submodule (or any attribute) of a model by its dotted name, as `named_modules()` prints it.

Code that swaps layers (LoRA wrappers, compression, token dropping) walks `model.named_modules()`, keeps the
names of the layers it wants, and then needs the layer behind `"decoder.layers.0.self_attn.q_proj"` and a
way to put a replacement at that name. `torch.nn.Module.get_submodule` covers the first half for modules
only; these two functions work on any object and any attribute (a parameter, a plain field), which is what
DeepSpeed's `recursive_getattr`/`recursive_setattr` are used for. Setting goes through the parent's
`__setattr__`, so a module put on an `nn.Module` is registered as its child (and a `Parameter` as its
parameter), exactly as `parent.name = value` would.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["recursive_getattr", "recursive_setattr"]

logger = logging.getLogger(__name__)


def _walk(root: Any, parts: list[str], dotted: str) -> Any:
    """The object at `parts` below `root`; an AttributeError names the first missing part and the full path."""
    current = root
    for depth, part in enumerate(parts):
        try:
            current = getattr(current, part)
        except AttributeError:
            reached = ".".join(parts[:depth]) or "<root>"
            raise AttributeError(
                f"{type(current).__name__} at {reached!r} has no attribute {part!r} (looking up {dotted!r} "
                f"on {type(root).__name__}); names are as model.named_modules() prints them"
            ) from None
    return current


def recursive_getattr(model: Any, module_name: str) -> Any:
    """`model.a.b.c` for `module_name="a.b.c"` (a `ModuleList`/`Sequential` index is a part too: `"layers.0"`).

    Raises:
        AttributeError: a part of the path does not exist (names that part and the whole path).
    """
    return _walk(model, module_name.split("."), module_name)


def recursive_setattr(model: Any, module_name: str, module: Any) -> None:
    """`model.a.b.c = module` for `module_name="a.b.c"`: the parent `model.a.b` is looked up, then set on.

    Raises:
        AttributeError: a part of the parent's path does not exist (the last part may be new).
    """
    *parents, leaf = module_name.split(".")
    owner = _walk(model, parents, module_name)
    owner.__setattr__(leaf, module)
