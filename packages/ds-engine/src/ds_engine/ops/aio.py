"""`deepspeed.ops.aio`: the async I/O op's builder (`AsyncIOBuilder`, ds-ops') under DeepSpeed's path.

Scripts and tests check `AsyncIOBuilder().is_compatible()` here before configuring NVMe offload.
"""

from __future__ import annotations

from ds_ops.op_builder import AsyncIOBuilder

__all__ = ["AsyncIOBuilder"]
