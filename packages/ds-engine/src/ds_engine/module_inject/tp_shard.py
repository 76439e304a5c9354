"""`deepspeed.module_inject.tp_shard`: how AutoTP splits one dimension over the tensor-parallel ranks.

`AutoTPMeta`, `get_shard_size` and `get_shard_size_list` are ds-parallel's (`ds_parallel.tensor`), the
same rules its layers cut by. Needs the `parallel` extra: without ds-parallel, importing this module
raises ImportError naming `pip install 'ds-engine[parallel]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.tensor import AutoTPMeta, get_shard_size, get_shard_size_list  # noqa: F401

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.module_inject.tp_shard",
    "ds_parallel.tensor",
    extra="parallel",
    feature="ds_engine.module_inject.tp_shard (deepspeed.module_inject.tp_shard, AutoTP shard sizes)",
    names=("AutoTPMeta", "get_shard_size", "get_shard_size_list"),
)
