"""`deepspeed.runtime.zero.muon.original_muon`: the Muon step and its Newton–Schulz iteration (from ds-ops)."""

from __future__ import annotations

from ds_ops import MuonWithAuxAdam, muon_update
from ds_ops import newton_schulz_orthogonalize as zeropower_via_newtonschulz5

__all__ = ["MuonWithAuxAdam", "muon_update", "zeropower_via_newtonschulz5"]
