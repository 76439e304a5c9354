"""`deepspeed.linear.optimized_linear`: the very module `ds_engine._linear.optimized_linear`."""

from __future__ import annotations

from ds_engine._reexport import alias_module

alias_module(__name__, "ds_engine._linear.optimized_linear")
