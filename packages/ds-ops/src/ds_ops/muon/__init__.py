"""Muon (MomentUm Orthogonalized by Newton–Schulz) with an auxiliary Adam, DeepSpeed's `"type": "Muon"`."""

from __future__ import annotations

from ds_ops.muon._newton_schulz import NS_COEFFICIENTS, NS_METHODS, muon_update, newton_schulz_orthogonalize
from ds_ops.muon._optimizer import AUX_ADAM_DEFAULTS, MUON_DEFAULTS, MuonWithAuxAdam

__all__ = [
    "AUX_ADAM_DEFAULTS",
    "MUON_DEFAULTS",
    "NS_COEFFICIENTS",
    "NS_METHODS",
    "MuonWithAuxAdam",
    "muon_update",
    "newton_schulz_orthogonalize",
]
