"""`RepeatingLoader` (`deepspeed.utils` / `deepspeed.runtime.dataloader`) restarts its loader endlessly."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ds_engine.runtime import dataloader
from ds_engine.utils import RepeatingLoader


def test_same_object_on_both_paths() -> None:
    assert dataloader.RepeatingLoader is RepeatingLoader


def test_cycles_a_dataloader_batch_for_batch() -> None:
    data = torch.arange(10.0).reshape(5, 2)
    loader = DataLoader(TensorDataset(data), batch_size=2)  # 3 batches per pass, the last of 1 row
    rl = RepeatingLoader(loader)
    assert iter(rl) is rl and rl.loader is loader
    got = [batch[0] for batch in itertools.islice(rl, 7)]
    expected = [b[0] for b in loader] * 3
    assert len(got) == 7
    for g, e in zip(got, expected[:7], strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0)


def test_each_pass_calls_iter_again() -> None:
    passes = []

    class Epochs:
        def __iter__(self):  # type: ignore[no-untyped-def]
            passes.append(len(passes))
            return iter([f"e{len(passes)}a", f"e{len(passes)}b"])

    assert list(itertools.islice(RepeatingLoader(Epochs()), 5)) == ["e1a", "e1b", "e2a", "e2b", "e3a"]
    assert passes == [0, 1, 2]


def test_empty_loader_is_an_error_not_a_hang() -> None:
    with pytest.raises(ValueError, match="yields no items"):
        next(RepeatingLoader([]))
