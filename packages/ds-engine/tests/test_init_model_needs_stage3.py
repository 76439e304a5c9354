"""A model built under `zero.Init` (partitioned parameters) with a config that is not ZeRO stage 3 is refused
before anything moves, naming the key; at stage 3 the same model trains."""

from __future__ import annotations

import pytest
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_engine.config import DeepSpeedConfigError

ds_zero = pytest.importorskip("ds_zero", reason="zero.Init is ds-zero's: pip install 'ds-engine[zero]'")


@pytest.mark.parametrize("zero", [None, {"stage": 1}, {"stage": 2}])
def test_partitioned_model_below_stage_3_is_a_config_error(zero: dict | None) -> None:
    with ds_zero.Init():
        model = tiny_net(0)
    shard = model.l1.weight.ds_tensor.clone()
    cfg = base_config() if zero is None else base_config(zero_optimization=zero)
    with pytest.raises(DeepSpeedConfigError, match=r"zero_optimization.stage: .*partitioned .*'l1.weight'.*zero.Init"):
        make_engine(model, cfg)
    assert model.l1.weight.ds_tensor.equal(shard)  # untouched


def test_the_same_model_trains_at_stage_3() -> None:
    with ds_zero.Init():
        model = tiny_net(0)
    engine = make_engine(model, base_config(zero_optimization={"stage": 3}))
    x, y = batches(1, 4)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine.global_steps == 1
