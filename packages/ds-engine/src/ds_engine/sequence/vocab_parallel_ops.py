"""`deepspeed.sequence.vocab_parallel_ops`: ds-parallel's log-probs, entropy and KL over vocabulary-sharded logits."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_parallel's own
    from ds_parallel.sequence._vocab_ops import *  # noqa: F403

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.sequence.vocab_parallel_ops",
    "ds_parallel.sequence._vocab_ops",
    extra="parallel",
    feature="ds_engine.sequence.vocab_parallel_ops (per-token ops over vocabulary-sharded logits)",
)
