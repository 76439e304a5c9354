"""`deepspeed.runtime.zero.utils`: DeepSpeed's ZeRO helpers, checked against plain Python/PyTorch results."""

from __future__ import annotations

import collections
import logging
import typing

import pytest
import torch

import ds_ops

pytest.importorskip("ds_zero", reason="deepspeed.runtime.zero needs ds-zero: pip install 'ds-engine[zero]'")

from ds_engine.runtime.zero import utils as zu  # noqa: E402


class _Pair(typing.NamedTuple):
    left: torch.Tensor
    right: object


class _AdamSubclass(torch.optim.Adam):
    pass


def test_supported_optimizers_are_an_exact_type_check() -> None:
    params = [torch.nn.Parameter(torch.zeros(2))]
    assert zu.is_zero_supported_optimizer(torch.optim.AdamW(params))
    assert zu.is_zero_supported_optimizer(ds_ops.DeepSpeedCPUAdam(params))
    assert not zu.is_zero_supported_optimizer(torch.optim.SGD(params, lr=0.1))
    assert not zu.is_zero_supported_optimizer(_AdamSubclass(params))


def test_zero_runtime_exception_is_an_exception_users_can_catch() -> None:
    with pytest.raises(Exception, match="boom"):
        raise zu.ZeRORuntimeException("boom")


def test_namedtuple_and_builtin_detection() -> None:
    point = collections.namedtuple("point", "x y")(1, 2)
    assert zu.isinstance_namedtuple(point) and zu.isinstance_namedtuple(_Pair(torch.ones(1), None))
    assert not zu.isinstance_namedtuple((1, 2))
    assert zu.is_builtin_type(3) and zu.is_builtin_type(None) and zu.is_builtin_type("s")
    assert not zu.is_builtin_type(torch.ones(1)) and not zu.is_builtin_type(point)


def test_apply_to_tensors_only_walks_containers_and_keeps_their_types(caplog: pytest.LogCaptureFixture) -> None:
    class Marker:
        pass

    mapping = {"a": torch.ones(2), "b": [torch.full((1,), 3.0), (torch.zeros(1), "text")]}
    nested = _Pair(torch.arange(3.0), Marker())
    with caplog.at_level(logging.WARNING, logger="DeepSpeed"):
        out = zu.apply_to_tensors_only(lambda t: t * 2, [mapping, nested], warning_msg_fn=lambda v: f"saw {v!r}")
    assert type(out) is list and out[0] is mapping  # dicts are updated in place
    torch.testing.assert_close(mapping["a"], torch.full((2,), 2.0))
    torch.testing.assert_close(mapping["b"][0], torch.full((1,), 6.0))
    assert type(mapping["b"][1]) is tuple and mapping["b"][1][1] == "text"
    assert type(out[1]) is _Pair
    torch.testing.assert_close(out[1].left, torch.tensor([0.0, 2.0, 4.0]))
    assert isinstance(out[1].right, Marker)
    assert sum("saw" in r.message for r in caplog.records) == 1  # the non-builtin leaf, warned once


def test_flat_buffer_mapping_and_defragment_keep_values_and_shapes() -> None:
    tensors = [torch.randn(2, 3), torch.randn(4), torch.randn(1, 1, 2)]
    expected = [t.clone() for t in tensors]
    mapping = zu.get_mapping_to_flat_buffer(tensors)
    assert [(offset, numel) for _, offset, numel in mapping] == [(0, 6), (6, 4), (10, 2)]
    buffer = zu.defragment(tensors)
    assert buffer.numel() == 12 and buffer.is_contiguous()
    for tensor, want in zip(tensors, expected, strict=True):
        assert tensor.shape == want.shape
        torch.testing.assert_close(tensor, want)
        assert tensor.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    torch.testing.assert_close(buffer, torch.cat([t.reshape(-1) for t in expected]))


def test_defragment_refuses_mixed_dtypes() -> None:
    with pytest.raises(ValueError, match="one dtype on one device"):
        zu.defragment([torch.zeros(2), torch.zeros(2, dtype=torch.float64)])


def test_rank_agreement_in_a_world_of_one_and_norm_dtype() -> None:
    zu.assert_ints_same_as_other_ranks([3, 1, 4])
    assert zu.get_lst_from_rank0([5, 9]) == [5, 9]
    assert zu.get_norm_dtype() is torch.float64
    assert not zu.is_zero_param(torch.ones(1)) and not zu.is_zero_param(3)
