"""`deepspeed.ops.op_builder.evoformer_attn`: the concrete Evoformer attention builder (ds-ops' `EvoformerAttnBuilder`).

It finds CUTLASS and reports flags and compatibility as DeepSpeed's does, but ds has no Evoformer
kernel, so it is never compatible and `load()` raises. The accelerator-dispatched name
`deepspeed.ops.op_builder.EvoformerAttnBuilder` stays `NotImplementedBuilder`, as for every op ds lacks.
"""

from __future__ import annotations

from ds_ops.op_builder import EvoformerAttnBuilder

__all__ = ["EvoformerAttnBuilder"]
