"""`deepspeed.checkpoint.ds_to_universal`: ds-zero's universal-checkpoint converter under DeepSpeed's module path.

`python -m deepspeed.checkpoint.ds_to_universal --input_folder ... --output_folder ...` (or
`python -m ds_engine.checkpoint.ds_to_universal`, or the `ds_to_universal` command) runs
`ds_zero.ds_to_universal.main`. Needs the `zero` extra: without ds-zero, importing this module raises
ImportError naming `pip install 'ds-engine[zero]'`.

`_aggregate_autoep_zero12_metadata(DeepSpeedCheckpoint(dir).model_state_metadata)` is DeepSpeed's
private check of the model-states summaries before a ZeRO-1/2 conversion (`model_state_metadata.py`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport
from ds_engine.checkpoint.model_state_metadata import (
    aggregate_autoep_zero12_metadata as _aggregate_autoep_zero12_metadata,  # noqa: F401 - DeepSpeed's private name
)

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero.ds_to_universal import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.checkpoint.ds_to_universal",
    "ds_zero.ds_to_universal",
    extra="zero",
    feature="ds_engine.checkpoint.ds_to_universal (deepspeed.checkpoint.ds_to_universal, universal checkpoints)",
)

if __name__ == "__main__":  # `python -m ds_engine.checkpoint.ds_to_universal ...`, as DeepSpeed's module runs
    import sys

    from ds_engine._optional import require

    sys.exit(require("ds_zero", extra="zero", feature="ds_to_universal").ds_to_universal.main())
