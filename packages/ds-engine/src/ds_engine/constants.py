"""`deepspeed.constants` is the module `ds_engine.config._constants` (one object: `_reexport.alias_module`)."""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_engine.config._constants import *  # noqa: F403

alias_module(__name__, "ds_engine.config._constants")
