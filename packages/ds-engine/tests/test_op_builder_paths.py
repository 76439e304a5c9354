"""`deepspeed.ops.op_builder` is a package, as in DeepSpeed: its `builder` and `evoformer_attn` modules hold ds-ops'
classes, while the accelerator-dispatched `EvoformerAttnBuilder` stays the not-implemented builder."""

from __future__ import annotations

import pytest

import ds_ops.op_builder
from ds_engine.ops import op_builder
from ds_engine.ops.op_builder.builder import CUDAOpBuilder, OpBuilder
from ds_engine.ops.op_builder.evoformer_attn import EvoformerAttnBuilder


def test_submodules_hold_ds_ops_classes() -> None:
    assert CUDAOpBuilder is ds_ops.op_builder.CUDAOpBuilder and OpBuilder is ds_ops.op_builder.OpBuilder
    assert EvoformerAttnBuilder is ds_ops.op_builder.EvoformerAttnBuilder
    assert issubclass(EvoformerAttnBuilder, CUDAOpBuilder) and EvoformerAttnBuilder.NAME == "evoformer_attn"


def test_dispatched_name_is_not_implemented_and_the_concrete_builder_never_loads() -> None:
    assert op_builder.EvoformerAttnBuilder is op_builder.NotImplementedBuilder
    assert op_builder.CPUAdamBuilder is ds_ops.op_builder.CPUAdamBuilder  # the package kept its names
    with pytest.raises(ds_ops.op_builder.OpNotCompatibleError, match="no Evoformer attention kernel"):
        EvoformerAttnBuilder().load()
