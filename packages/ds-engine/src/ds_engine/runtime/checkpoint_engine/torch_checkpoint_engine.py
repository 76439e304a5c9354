"""DeepSpeed's path over ds's module of the same code (one object: `_reexport.alias_module`)."""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_engine._checkpoint.torch_checkpoint_engine import *  # noqa: F403

alias_module(__name__, "ds_engine._checkpoint.torch_checkpoint_engine")
