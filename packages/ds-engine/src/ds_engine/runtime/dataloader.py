"""`deepspeed.runtime.dataloader`, DeepSpeed's module path: `_data.repeating_loader` (`RepeatingLoader`) under it.

Both names are one module object (`_reexport.alias_module`).
"""

from typing import TYPE_CHECKING

from ds_engine._reexport import alias_module

if TYPE_CHECKING:
    from ds_engine._data.repeating_loader import *  # noqa: F403

alias_module(__name__, "ds_engine._data.repeating_loader")
