"""`deepspeed.utils.groups`: ds-parallel's groups helpers, views of its process mesh.

`_get_sequence_parallel_group()`, `_get_data_parallel_world_size()`, ... are looked up on
`ds_parallel.groups` at each access. Needs the `parallel` extra.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.groups import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.utils.groups",
    "ds_parallel.groups",
    extra="parallel",
    feature="ds_engine.utils.groups (deepspeed.utils.groups, the process mesh)",
)
