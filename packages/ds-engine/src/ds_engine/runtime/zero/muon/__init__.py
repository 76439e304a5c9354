"""`deepspeed.runtime.zero.muon`: DeepSpeed's home of the Muon optimizer (ds-ops implements it)."""

from __future__ import annotations
