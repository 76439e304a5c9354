"""`deepspeed.runtime.utils` helpers in one process: device moves, memory report, norms, seeding."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from ds_engine.runtime.utils import (
    call_to_str,
    clip_grad_norm_,
    copy_to_device,
    empty_cache,
    ensure_directory_exists,
    get_global_norm,
    has_inf_or_nan,
    is_model_parallel_parameter,
    move_to_device,
    see_memory_usage,
    set_random_seed,
)


def test_move_to_device_rebuilds_containers_and_moves_in_place_on_criterion() -> None:
    a, b = torch.ones(2), torch.zeros(3, dtype=torch.float64)
    batch = {"x": [a, (b, 7)], "name": "s"}
    moved = move_to_device(batch, "meta")
    assert moved["x"][0].device.type == "meta" and moved["x"][1][0].device.type == "meta"
    assert moved["x"][1][1] == 7 and moved["name"] == "s" and isinstance(moved["x"][1], tuple)
    assert a.device.type == "cpu"  # without a criterion: copies
    c = torch.ones(2)
    c_data = c.data
    same = move_to_device([c, b], "cpu", criterion_func=lambda t: t is c)
    assert same[0] is c and c.data is not c_data  # with one: the tensor itself, its data replaced
    assert same[1] is b  # .to() of a tensor already there


def test_copy_to_device_copies_only_what_the_criterion_accepts() -> None:
    a, b = torch.ones(2), torch.ones(2, dtype=torch.int64)
    out = copy_to_device({"a": a, "b": b}, "meta", lambda t: torch.is_tensor(t) and t.is_floating_point())
    assert out["a"].device.type == "meta" and a.device.type == "cpu" and out["b"] is b


def test_see_memory_usage_prints_only_when_forced(capsys: pytest.CaptureFixture[str]) -> None:
    see_memory_usage("quiet")
    assert capsys.readouterr().out == ""
    see_memory_usage("after init", force=True)
    out = capsys.readouterr().out
    assert out.startswith("after init\nMA ") and "Max_CA" in out
    empty_cache()


def test_get_global_norm() -> None:
    assert get_global_norm([3.0, torch.tensor(4.0)]) == pytest.approx(5.0)
    assert get_global_norm([1.0, float("nan")]) == math.inf and get_global_norm([-1.0]) == math.inf


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
def test_clip_grad_norm_matches_torch_in_one_process(norm_type: float) -> None:
    torch.manual_seed(0)
    ours, ref = nn.Linear(5, 3), nn.Linear(5, 3)
    ref.load_state_dict(ours.state_dict())
    ours(torch.randn(4, 5)).pow(2).sum().backward()
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        q.grad = p.grad.clone()
    norm = clip_grad_norm_(ours.parameters(), 0.1, norm_type=norm_type)
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1, norm_type=norm_type)
    torch.testing.assert_close(norm, expected)
    for p, q in zip(ours.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_has_inf_or_nan_and_model_parallel_flag() -> None:
    assert not has_inf_or_nan(torch.ones(3)) and has_inf_or_nan(torch.tensor([1.0, float("inf")]))
    assert not has_inf_or_nan(torch.empty(0))
    p = nn.Parameter(torch.ones(1))
    assert not is_model_parallel_parameter(p)
    p.tensor_model_parallel = True
    assert is_model_parallel_parameter(p)


def test_set_random_seed_and_directories(tmp_path: Path) -> None:
    set_random_seed(2**70 + 5)  # wider than numpy's and torch's seeds: reduced, as DeepSpeed does
    first = (random.random(), torch.rand(1))
    set_random_seed(2**70 + 5)
    assert first == (random.random(), torch.rand(1))
    target = tmp_path / "a" / "b" / "file.pt"
    ensure_directory_exists(str(target))
    ensure_directory_exists(str(target))
    assert target.parent.is_dir()


def test_call_to_str_renders_positional_then_keyword_arguments() -> None:
    assert call_to_str("step") == "step()"
    assert call_to_str("load", 3, "a") == "load(3, 'a')"
    assert call_to_str("send", buffer_id=1) == "send(buffer_id=1)"
    assert call_to_str("f", [1], None, x="y", n=2.5) == "f([1], None, x='y', n=2.5)"
