"""`deepspeed.io.constants`, DeepSpeed's module path: ds-ops' statistic names (`ds_ops.fast_io.constants`) under it.

Both names are one module object (`_reexport.alias_module`).
"""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_ops.fast_io.constants import *  # noqa: F403

alias_module(__name__, "ds_ops.fast_io.constants")
