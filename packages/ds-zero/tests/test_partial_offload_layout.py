"""Partial offload's tile arithmetic (`offload_optimizer.ratio`): DeepSpeed's count, cut where the tiles are cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import ds_zero
from ds_ops import DeepSpeedCPUAdagrad, DeepSpeedCPUAdam
from ds_zero._stage3.partial_offload import device_tile_counts, tile_bounds


@pytest.mark.parametrize(
    ("sizes", "tile", "expected"),
    [
        ([4, 4, 4], 8, [(0, 2), (2, 3)]),
        ([10, 1, 1], 8, [(0, 1), (1, 3)]),  # a larger shard is a tile of its own
        ([3, 3, 3, 3], 100, [(0, 4)]),
        ([], 8, [(0, 0)]),
    ],
)
def test_tile_bounds(sizes: list[int], tile: int, expected: list[tuple[int, int]]) -> None:
    assert tile_bounds(sizes, tile) == expected


def test_tile_bounds_match_the_partition_cut() -> None:
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    base = torch.optim.AdamW(model.parameters())
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config={"stage": 3, "sub_group_size": 150})
    part = opt.partitions[0]
    assert [(t.start, t.end) for t in part.tiles] == [
        (part.offsets[a], part.offsets[b] if b < len(part.offsets) else part.numel)
        for a, b in tile_bounds(part.sizes, 150)
    ]


def test_device_tile_counts_follow_deepspeeds_rule() -> None:
    # 2 groups of 3 and 2 tiles: n = 5, int((1 - 0.5) * 5) = 2 leading tiles stay on the device
    sizes = [[4, 4, 4], [4, 4]]
    assert device_tile_counts(sizes, 4, 0.5) == [2, 0]
    assert device_tile_counts(sizes, 4, 0.2) == [3, 1]
    assert device_tile_counts(sizes, 4, 1.0) == [0, 0]
    assert device_tile_counts(sizes, 4, 0.0) == [3, 2]


def test_partial_offload_layout_and_refusals() -> None:
    cfg = {"stage": 3, "sub_group_size": 150, "offload_optimizer": {"device": "cpu", "ratio": 0.4}}
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(5)])
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.AdamW(model.parameters()), config=cfg)
    n = len(opt.tiles)
    assert len(opt._placement.device_tiles) == int(0.6 * n) and len(opt._placement.cpu_tiles) == n - int(0.6 * n)
    assert opt.tiles == opt._placement.device_tiles + opt._placement.cpu_tiles  # same order as full offload
    assert opt.optimizer.param_groups[0]["params"] == [t.master for t in opt.tiles]
    model = torch.nn.Sequential(torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match=r"offload_optimizer.ratio < 1 .*DeepSpeedCPUAdagrad runs on the CPU only"):
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, DeepSpeedCPUAdagrad(model.parameters()), config=cfg)


def _linear_stack(seed: int, ratio: float) -> tuple[torch.nn.Module, ds_zero.DeepSpeedZeroOptimizer_Stage3]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
    cfg = {"stage": 3, "sub_group_size": 100, "offload_optimizer": {"device": "cpu", "ratio": ratio}}
    return model, ds_zero.DeepSpeedZeroOptimizer_Stage3(
        model, DeepSpeedCPUAdam(model.parameters(), lr=0.05), config=cfg
    )


def _steps(model: torch.nn.Module, opt: ds_zero.DeepSpeedZeroOptimizer_Stage3, steps: range) -> list[float]:
    losses = []
    for step in steps:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_partial_offload_checkpoint_resumes(tmp_path: Path) -> None:
    """A partial-offload run saved and loaded (into partial or full offload) continues exactly; the device
    twin follows the base optimizer's state after the load replaced it."""
    model, opt = _linear_stack(0, 0.5)
    assert opt._placement.device_tiles and opt._placement.cpu_tiles
    _steps(model, opt, range(3))
    ds_zero.save_zero_checkpoint(str(tmp_path), "t", opt, model)
    expected = _steps(model, opt, range(3, 6))
    for ratio in (0.5, 1.0):
        fresh, fresh_opt = _linear_stack(7, ratio)
        ds_zero.load_zero_checkpoint(str(tmp_path), fresh_opt, fresh)
        assert _steps(fresh, fresh_opt, range(3, 6)) == expected, ratio
