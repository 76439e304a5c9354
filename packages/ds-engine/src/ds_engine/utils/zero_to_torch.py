"""`deepspeed.utils.zero_to_torch`: ds-zero's `zero_to_torch` command line (`main`).

Needs the `zero` extra: without ds-zero, importing this module raises ImportError naming
`pip install 'ds-engine[zero]'`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero.zero_to_torch import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.utils.zero_to_torch",
    "ds_zero.zero_to_torch",
    extra="zero",
    feature="ds_engine.utils.zero_to_torch (deepspeed.utils.zero_to_torch, ZeRO checkpoint consolidation)",
)

if __name__ == "__main__":  # `python -m ds_engine.utils.zero_to_torch CKPT OUT --dtype bf16`, as DeepSpeed's runs
    import sys

    from ds_engine._optional import require

    sys.exit(require("ds_zero", extra="zero", feature="zero_to_torch").zero_to_torch.main())
