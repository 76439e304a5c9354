"""`deepspeed.linear.quantization`: this path is ds's `ds_engine._linear.quantization` (the same module object)."""

from __future__ import annotations

from ds_engine._reexport import alias_module

alias_module(__name__, "ds_engine._linear.quantization")
