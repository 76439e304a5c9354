"""`deepspeed.runtime.checkpoint_engine.utils`, DeepSpeed's module path: ds's own module under it.

The code lives in `ds_engine._checkpoint.checkpoint_engine_factory`;
both names are one module object (`_reexport.alias_module`).
"""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_engine._checkpoint.checkpoint_engine_factory import *  # noqa: F403

alias_module(__name__, "ds_engine._checkpoint.checkpoint_engine_factory")
