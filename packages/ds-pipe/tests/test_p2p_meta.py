"""p2p descriptions: encoding round trips and clear errors for what cannot travel between stages."""

from __future__ import annotations

import pytest
import torch

from ds_pipe._p2p import _decode, _encode, _show, describe


def test_round_trip_tuple_with_non_grad_tensors() -> None:
    h = torch.zeros(2, 3, requires_grad=True)
    mask = torch.zeros(2, 1, dtype=torch.int64)
    flag = torch.zeros((), dtype=torch.bool)
    meta = describe((h, mask, flag))
    assert meta == (True, ((torch.float32, True, (2, 3)), (torch.int64, False, (2, 1)), (torch.bool, False, ())))
    assert _decode(_encode(meta)) == meta
    assert _show(meta) == "(float32[2, 3], int64[2, 1], bool[])"


def test_round_trip_single_tensor() -> None:
    meta = describe(torch.zeros(4, 5, 6, dtype=torch.bfloat16))
    assert meta == (False, ((torch.bfloat16, False, (4, 5, 6)),))
    assert _decode(_encode(meta)) == meta


def test_non_tensor_outputs_are_rejected() -> None:
    with pytest.raises(TypeError, match="element 1 of the stage output is a int"):
        describe((torch.zeros(1), 3))
