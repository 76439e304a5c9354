"""`deepspeed.module_inject`: ds-parallel's AutoTP layers (`LinearLayer`, `LinearAllreduce`) and `set_autotp_mode`.

Needs the `parallel` extra: without ds-parallel, importing this package raises ImportError naming
`pip install 'ds-engine[parallel]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.tensor import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.module_inject",
    "ds_parallel.tensor",
    extra="parallel",
    feature="ds_engine.module_inject (deepspeed.module_inject, automatic tensor parallelism)",
)
