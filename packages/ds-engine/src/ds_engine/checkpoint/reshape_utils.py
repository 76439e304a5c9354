"""`deepspeed.checkpoint.reshape_utils`, DeepSpeed's module path: ds's own module under it.

The code lives in `ds_engine._checkpoint.offline.reshape_utils`;
both names are one module object (`_reexport.alias_module`).
"""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_engine._checkpoint.offline.reshape_utils import *  # noqa: F403

alias_module(__name__, "ds_engine._checkpoint.offline.reshape_utils")
