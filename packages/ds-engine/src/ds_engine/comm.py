"""`deepspeed.comm`, DeepSpeed's module path: ds's own module under it.

The code lives in `ds_engine._comm`; both names are one module object (`_reexport.alias_module`), so a
patch through either name is seen by ds's code.
"""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_engine._comm import *  # noqa: F403

alias_module(__name__, "ds_engine._comm")
