"""`LayerSpec` and `TiedLayerSpec`: a layer's recipe, built only on the stage that owns it."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

__all__ = ["LayerSpec", "TiedLayerSpec"]


def _call_repr(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> str:
    shown = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"{name}({', '.join(shown)})"


class LayerSpec:
    """The class and constructor arguments of one pipeline layer, so that only its owning stage builds it.

    A 100-layer model on 8 stages thus allocates each layer once, on one stage, instead of building
    the whole model everywhere and throwing most of it away.

    Args:
        typename: an `nn.Module` subclass.
        *module_args: positional constructor arguments.
        **module_kwargs: keyword constructor arguments.

    Raises:
        TypeError: `typename` is not an `nn.Module` subclass.
    """

    def __init__(self, typename: type[nn.Module], *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec: typename must be an nn.Module subclass, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self, log: bool = False) -> nn.Module:
        """Construct the layer (`typename(*module_args, **module_kwargs)`)."""
        if log:
            logger.info("building %r", self)
        return self.typename(*self.module_args, **self.module_kwargs)

    def count_parameters(self) -> int:
        """Trainable parameter count, found by building the layer on the meta device (no memory, no RNG)."""
        try:
            with torch.device("meta"):
                module = self.build()
        except Exception:  # noqa: BLE001 - a constructor that cannot run on meta is still countable
            logger.warning("%r could not be built on the meta device; counting on the CPU", self)
            module = self.build()
        return sum(p.numel() for p in module.parameters() if p.requires_grad)

    def __repr__(self) -> str:
        return _call_repr(self.typename.__name__, self.module_args, self.module_kwargs)


class TiedLayerSpec(LayerSpec):
    """A layer whose weights are shared with every other `TiedLayerSpec` of the same `key`.

    The typical use is a tied input embedding and output projection on the first and last stage.
    Within one stage all occurrences of a key use one module instance. Across stages each owning
    stage holds a copy; the copies start equal (broadcast from the lowest owning stage at
    construction) and stay equal because their gradients are summed over the tie group before each
    optimizer step (`ReduceTiedGrads`).

    Args:
        key: the tie name; specs with the same key share weights.
        typename: an `nn.Module` subclass (built once per owning stage).
        *module_args: positional constructor arguments.
        forward_fn: how this occurrence uses the module, `forward_fn(module, inputs)`; default
            `module(inputs)` (e.g. an output head reusing an embedding's weight).
        tied_weight_attr: the attribute name(s) of the tied parameters (default `["weight"]`;
            dotted paths reach submodules).
        **module_kwargs: keyword constructor arguments.
    """

    def __init__(
        self,
        key: str,
        typename: type[nn.Module],
        *module_args: Any,
        forward_fn: Callable[[Any, Any], Any] | None = None,
        tied_weight_attr: str | Sequence[str] = ("weight",),
        **module_kwargs: Any,
    ) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key:
            raise TypeError(f"TiedLayerSpec: key must be a non-empty str, got {key!r}")
        self.key = key
        self.forward_fn = forward_fn
        self.tied_weight_attr: list[str] = (
            [tied_weight_attr] if isinstance(tied_weight_attr, str) else list(tied_weight_attr)
        )

    def __repr__(self) -> str:
        return f"TiedLayerSpec(key={self.key!r}, {super().__repr__()})"
