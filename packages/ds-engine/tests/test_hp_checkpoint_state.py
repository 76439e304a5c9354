"""`load_hp_checkpoint_state`: one parameter's universal folder loaded into a high-precision fragment
(DeepSpeed's `_hp_mapping` protocol), this rank's shard cut by the AutoTP record when there is one and by
the file's own keys otherwise, compared with the same cut made by plain tensor slicing; and the ZeRO and
bf16 optimizers' `universal_checkpoint_info` read from the parameters once, at construction."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from ds_engine._report.timers import NullTimers
from ds_engine._step.precision import MixedPrecisionOptimizer
from ds_engine.checkpoint.universal_checkpoint import enable_universal_checkpoint, load_hp_checkpoint_state
from ds_ops.precision import LossScaler


class _Mapping:
    """A fragment [start, start + numel) of the flattened rank shard, held in `hp`."""

    def __init__(self, start: int, numel: int) -> None:
        self.lp_fragment_address = SimpleNamespace(start=start, numel=numel)
        self.hp = torch.zeros(numel)
        self.optim_fragment: dict[str, torch.Tensor] = {}

    def get_hp_fragment(self) -> torch.Tensor:
        return self.hp


def _param(shape: tuple[int, ...], start: int, numel: int, meta: dict[str, Any] | None = None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape))
    p._hp_mapping = _Mapping(start, numel)  # type: ignore[attr-defined]
    if meta is not None:
        p.ds_autotp_universal_checkpoint_meta = meta  # type: ignore[attr-defined]
    enable_universal_checkpoint([p])
    return p


def _write(folder: Path, whole: torch.Tensor, **keys: Any) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({**keys, "param": whole}, folder / "fp32.pt")
    torch.save({**keys, "param": whole * 2}, folder / "exp_avg.pt")
    torch.save(torch.tensor(5), folder / "step.pt")


def test_autotp_record_cuts_uneven_column_shard(tmp_path: Path) -> None:
    whole = torch.randn(7, 3)
    _write(tmp_path, whole, cat_dim=0)
    meta = {"partition_type": "column", "partition_dim": 0, "logical_shape": (7, 3), "partition_sizes": (4, 3)}
    p = _param((3, 3), 2, 5, meta)  # rank 1 holds rows 4..6; this fragment is 5 of its 9 elements
    step = p.load_hp_checkpoint_state(str(tmp_path), tp_rank=1, tp_world_size=2)  # type: ignore[attr-defined]
    assert int(step) == 5
    expected = whole[4:].flatten()[2:7]
    assert torch.equal(p._hp_mapping.hp, expected)  # type: ignore[attr-defined]
    assert torch.equal(p._hp_mapping.optim_fragment["exp_avg"], expected * 2)  # type: ignore[attr-defined]


def test_autotp_record_keeps_the_group_when_one_rank_holds_all(tmp_path: Path) -> None:
    whole = torch.randn(3, 2)  # one q, k and v head each: rank 0 holds all of them, rank 1 none
    _write(tmp_path, whole)
    meta = {
        "universal_checkpoint_version": 0.4,
        "partition_dim": 0,
        "logical_shape": (3, 2),
        "sub_param_sizes": (1, 1, 1),
        "sub_param_shard_widths": [[1, 0], [1, 0], [1, 0]],
    }
    p = _param((3, 2), 0, 6, meta)
    load_hp_checkpoint_state(p, str(tmp_path), 0, 2)
    assert torch.equal(p._hp_mapping.hp, whole.flatten())  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("keys", "shape", "rank", "cut"),
    [
        ({"cat_dim": 1}, (4, 3), 1, lambda w: w[:, 3:]),  # row parallel
        ({"cat_dim": 0, "param_n_sub_params": 2}, (2, 6), 1, lambda w: torch.cat([w[1:2], w[3:4]])),
        ({}, (4, 6), 1, lambda w: w),  # the same shape as the whole: replicated
    ],
)
def test_without_a_record_the_files_keys_say_how(tmp_path: Path, keys: dict, shape: tuple, rank: int, cut: Any) -> None:
    whole = torch.randn(4, 6)
    _write(tmp_path, whole, **keys)
    p = _param(shape, 0, math.prod(shape))
    load_hp_checkpoint_state(p, str(tmp_path), rank, 2)
    assert torch.equal(p._hp_mapping.hp, cut(whole).flatten())  # type: ignore[attr-defined]


def test_vocabulary_is_padded_to_the_target_and_a_wrong_size_refused(tmp_path: Path) -> None:
    whole = torch.randn(5, 2)
    _write(tmp_path, whole, vocab_tensor=True)
    p = _param((3, 2), 0, 6)  # 2 ranks x 3 rows: one padding row on rank 1
    load_hp_checkpoint_state(p, str(tmp_path), 1, 2)
    assert torch.equal(p._hp_mapping.hp, torch.cat([whole[3:], torch.zeros(1, 2)]).flatten())  # type: ignore[attr-defined]
    _write(tmp_path / "odd", torch.randn(5, 3))
    with pytest.raises(AssertionError, match="not 2 ranks x 4"):
        load_hp_checkpoint_state(_param((2, 2), 0, 4), str(tmp_path / "odd"), 0, 2)


def _bf16_optimizer(model: torch.nn.Module) -> MixedPrecisionOptimizer:
    """A single-process bf16 `MixedPrecisionOptimizer` (DeepSpeed's BF16_Optimizer) over SGD."""
    return MixedPrecisionOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        dtype=torch.bfloat16,
        loss_scaler=LossScaler(1.0),
        grad_accum_dtype=torch.float32,
        clip_grad=0.0,
        check_overflow=False,
        reduce=None,
        group=None,
        world_size=1,
        timers=NullTimers(),
    )


def test_zero_and_bf16_optimizers_cache_the_parameters_universal_info() -> None:
    ds_zero = pytest.importorskip("ds_zero")
    info = {"tp_replicated_parameter_patterns": ["^b$"]}
    model = torch.nn.Linear(4, 2)
    model.bias.universal_checkpoint_info = info  # type: ignore[attr-defined]
    zero = ds_zero.DeepSpeedZeroOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), config=ds_zero.ZeroConfig(stage=1), module=model
    )
    assert zero.bit16_groups == [[model.weight, model.bias]]
    del model.bias.universal_checkpoint_info
    assert zero._get_universal_checkpoint_info() is info and zero.state_dict()["universal_checkpoint_info"] is info
    half = torch.nn.Linear(4, 2).to(torch.bfloat16)
    half.weight.universal_checkpoint_info = info  # type: ignore[attr-defined]
    bf16 = _bf16_optimizer(half)
    assert bf16.bf16_groups == [[half.weight, half.bias]] and bf16._get_universal_checkpoint_info() is info
    assert bf16.state_dict()["universal_checkpoint_info"] is info
    plain = _bf16_optimizer(torch.nn.Linear(2, 2).to(torch.bfloat16))
    assert plain._get_universal_checkpoint_info() is None and "universal_checkpoint_info" not in plain.state_dict()
