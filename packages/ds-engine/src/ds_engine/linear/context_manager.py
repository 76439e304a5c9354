"""`deepspeed.linear.context_manager`: the very module `ds_engine._linear.context_manager`."""

from __future__ import annotations

from ds_engine._reexport import alias_module

alias_module(__name__, "ds_engine._linear.context_manager")
