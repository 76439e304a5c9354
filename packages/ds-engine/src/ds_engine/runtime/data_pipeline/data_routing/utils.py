"""`deepspeed.runtime.data_pipeline.data_routing.utils`: the per-sequence reference gather and scatter."""

from __future__ import annotations

from ds_engine._data.ltd_loops import bsh_decoder_gather, bsh_decoder_scatter

__all__ = ["bsh_decoder_gather", "bsh_decoder_scatter"]
