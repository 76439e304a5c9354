"""`ensure_zero_ordered_dict`: wraps a plain `_parameters` once, keeps the first original, leaves the rest alone."""

from __future__ import annotations

from torch import nn

import ds_zero
from ds_zero import ZeROOrderedDict, ensure_zero_ordered_dict


def test_plain_dict_is_wrapped_with_the_same_parameters_and_the_original_kept() -> None:
    m = nn.Linear(3, 2)
    original = m._parameters
    ensure_zero_ordered_dict(m)
    assert isinstance(m._parameters, ZeROOrderedDict)
    assert m._parameters._parent_module is m
    assert list(m._parameters.items()) == list(original.items())
    assert m._original_parameters is original
    wrapped = m._parameters
    ensure_zero_ordered_dict(m)  # idempotent
    assert m._parameters is wrapped


def test_a_second_wrap_keeps_the_first_original() -> None:
    m = nn.Linear(3, 2, bias=False)
    first = m._parameters
    m._original_parameters = first
    m._parameters = dict(first)
    ensure_zero_ordered_dict(m)
    assert m._original_parameters is first
    assert m._parameters["weight"] is first["weight"]


def test_missing_none_or_non_dict_parameters_are_left_alone() -> None:
    class Bare:
        pass

    bare = Bare()
    ensure_zero_ordered_dict(bare)
    assert not hasattr(bare, "_parameters")
    bare._parameters = None
    ensure_zero_ordered_dict(bare)
    assert bare._parameters is None


def test_partitioned_modules_get_one_and_reading_outside_forward_does_not_gather() -> None:
    m = nn.Linear(4, 4)
    ds_zero.partition_model(m)
    assert isinstance(m._parameters, ZeROOrderedDict)
    assert m.weight.ds_status is ds_zero.ZeroParamStatus.NOT_AVAILABLE
