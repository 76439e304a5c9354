"""`ZeroParamState` owns a partitioned parameter's status transitions and refuses one from the wrong status.

Single process (world size 1, no process group). A transition from a status it does not start from is a
bug in ds, not a user error; the RuntimeError names the parameter's `ds_id`, its name and its status, so
the bug is found where it happens instead of as NaN weights or a double free later.
"""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import ds_zero
from ds_zero import GatheredParameters, ZeroParamStatus
from ds_zero._params.partitioned_param import state_of


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    ds_zero.partition_model(model)
    return model


def test_gather_goes_released_inflight_available_and_release_goes_back() -> None:
    weight = _linear().weight
    expected = weight.ds_tensor.clone().view(3, 4)
    st = state_of(weight)
    assert st.param is weight
    st.start_gather()
    assert weight.ds_status is ZeroParamStatus.INFLIGHT
    st.gather_target()[: weight.ds_numel].copy_(weight.ds_tensor)
    st.finish_gather()
    assert weight.ds_status is ZeroParamStatus.AVAILABLE
    torch.testing.assert_close(weight.data, expected, atol=0, rtol=0)
    st.release()
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE
    assert st.full_flat.untyped_storage().nbytes() == 0
    assert torch.isnan(weight.data).all()


def test_releasing_a_released_parameter_names_it_and_its_status() -> None:
    weight = _linear().weight
    with pytest.raises(RuntimeError, match=rf"release parameter ds_id={weight.ds_id} .*NOT_AVAILABLE.*AVAILABLE"):
        state_of(weight).release()
    assert weight.ds_status is ZeroParamStatus.NOT_AVAILABLE


def test_a_second_gather_into_an_inflight_parameter_is_refused() -> None:
    weight = _linear().weight
    st = state_of(weight)
    st.start_gather()
    with pytest.raises(RuntimeError, match=rf"start a gather of parameter ds_id={weight.ds_id} .*INFLIGHT"):
        st.start_gather()
    with pytest.raises(RuntimeError, match=r"materialize parameter .*INFLIGHT, and materialize starts from"):
        st.materialize()


def test_finishing_a_gather_that_was_never_issued_is_refused() -> None:
    weight = _linear().weight
    with pytest.raises(RuntimeError, match=rf"finish the gather of parameter ds_id={weight.ds_id} .*NOT_AVAILABLE"):
        state_of(weight).finish_gather()
    with pytest.raises(RuntimeError, match=r"fill the gather of .*NOT_AVAILABLE, and .* starts from INFLIGHT"):
        state_of(weight).gather_target()


def test_a_regather_of_available_values_may_start_from_available() -> None:
    model = _linear()
    with GatheredParameters([model.weight]):
        st = state_of(model.weight)
        st.start_gather()  # the shards changed under gathered values (after a step): gathered again
        st.gather_target()[: model.weight.ds_numel].copy_(model.weight.ds_tensor)
        st.finish_gather()
        assert model.weight.ds_status is ZeroParamStatus.AVAILABLE
    assert model.weight.ds_status is ZeroParamStatus.NOT_AVAILABLE


def test_the_state_does_not_keep_its_parameter_alive() -> None:
    model = _linear()
    st = state_of(model.weight)
    del model
    gc.collect()  # DeepSpeed's per-parameter methods are bound to the parameter: a cycle
    with pytest.raises(RuntimeError, match="outlived its parameter"):
        st.release()
