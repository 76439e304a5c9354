"""`deepspeed.runtime.zero.muon.muon_optimizer`: `MuonWithAuxAdam`, the optimizer behind `"type": "Muon"`."""

from __future__ import annotations

from ds_ops import MuonWithAuxAdam

__all__ = ["MuonWithAuxAdam"]
