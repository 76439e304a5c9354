"""`deepspeed.ops` for migrated scripts: the optimizers of ds-ops under DeepSpeed's module paths.

`from ds_engine.ops.adam import DeepSpeedCPUAdam, FusedAdam`, `ds_engine.ops.adagrad.DeepSpeedCPUAdagrad`,
`ds_engine.ops.lion.DeepSpeedCPULion`. Importing them builds nothing: ops compile on first use.
"""

from __future__ import annotations

from ds_engine.ops import adagrad, adam, lion

__all__ = ["adagrad", "adam", "lion"]
