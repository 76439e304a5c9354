"""`deepspeed.utils.module_utils`: `recursive_getattr` / `recursive_setattr`, a model's attributes by dotted name.

They are ds-engine's (`ds_engine._parallel.module_attrs`): `recursive_getattr(model, "decoder.layers.0.fc1")` is that
layer, and `recursive_setattr(model, name, new_layer)` sets it on its parent (registering a module as a
child), which is how layer-swapping code (DeepSpeed-Chat's LoRA conversion) replaces the layers it found
with `named_modules()`.
"""

from __future__ import annotations

from ds_engine._parallel.module_attrs import recursive_getattr, recursive_setattr

__all__ = ["recursive_getattr", "recursive_setattr"]
