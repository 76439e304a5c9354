"""`deepspeed.nvme.validate_async_io`: importing it checks that the async I/O op builds and loads here.

Raises (at import) `OpNotCompatibleError` or `OpBuildError` naming what is missing.
"""

from __future__ import annotations

from ds_ops.op_builder import AsyncIOBuilder

AsyncIOBuilder().load(verbose=False)
