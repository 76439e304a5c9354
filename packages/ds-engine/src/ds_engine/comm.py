"""`deepspeed.comm` for migrated scripts: ds-comm's torch.distributed-like API under the name scripts use."""

from __future__ import annotations

from ds_comm import *  # noqa: F403 - this module is a re-export by design
from ds_comm import __all__ as _comm_all

__all__ = [name for name in _comm_all if name != "__version__"]
