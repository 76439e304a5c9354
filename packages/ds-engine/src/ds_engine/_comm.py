"""`deepspeed.comm` for migrated scripts: ds-comm's torch.distributed-like API under the name scripts use.

`ds_engine.comm` (DeepSpeed's path) *is* this module (`_reexport.alias_module`). ds's own code that calls
these functions (the groups helpers) imports this module, so a script or test that patches
`deepspeed.comm.get_rank` changes what that code calls. A leaf: it imports nothing of ds-engine's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import ds_comm

if TYPE_CHECKING:  # the names below are copied at run time; type checkers see ds_comm's own
    from ds_comm import *  # noqa: F403
#: ds_comm's config models: served on first access (they import pydantic, ~0.3 s), as ds_comm does.
_LAZY = frozenset({"CommsLoggerConfig", "ConfigModel", "find_auto", "find_ignored", "validate_section", "warn_ignored"})

__all__ = [name for name in ds_comm.__all__ if name != "__version__"]
globals().update({name: getattr(ds_comm, name) for name in __all__ if name not in _LAZY})


def __getattr__(name: str) -> object:
    if name in _LAZY:
        return getattr(ds_comm, name)
    raise AttributeError(f"module 'ds_engine.comm' has no attribute {name!r}")
