"""DeepSpeed's ZeRO memory estimators: the printed table, the formulas, and the parameter counting."""

from __future__ import annotations

import pytest
from torch import nn

import ds_zero

# DeepSpeed's documented example (t5-3b: 2,851,598,336 params, shared 32128x1024 embedding as the largest layer,
# 8 GPUs on one node), which its ZeRO-3 formulas reproduce to the printed digit.
T5_3B, T5_3B_LARGEST = 2_851_598_336, 32_128 * 1024
ZERO3_TABLE = """\
Estimated memory needed for params, optim states and gradients for a:
HW: Setup with 1 node, 8 GPUs per node.
SW: Model with 2851M total params, 32M largest layer params.
  per CPU  |  per GPU |   Options
   71.71GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=1
  127.48GB |   0.12GB | offload_param=cpu , offload_optimizer=cpu , zero_init=0
   63.74GB |   0.79GB | offload_param=none, offload_optimizer=cpu , zero_init=1
  127.48GB |   0.79GB | offload_param=none, offload_optimizer=cpu , zero_init=0
    1.47GB |   6.10GB | offload_param=none, offload_optimizer=none, zero_init=1
  127.48GB |   6.10GB | offload_param=none, offload_optimizer=none, zero_init=0"""


def test_zero3_table_is_deepspeeds(capsys: pytest.CaptureFixture[str]) -> None:
    text = ds_zero.estimate_zero3_model_states_mem_needs_all_cold(T5_3B, T5_3B_LARGEST, num_gpus_per_node=8)
    assert text == ZERO3_TABLE
    assert capsys.readouterr().out == ZERO3_TABLE + "\n"


def test_zero2_table(capsys: pytest.CaptureFixture[str]) -> None:
    ds_zero.estimate_zero2_model_states_mem_needs_all_cold(T5_3B, num_gpus_per_node=8, num_nodes=2)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "HW: Setup with 2 nodes, 8 GPUs per node."
    assert lines[2] == "SW: Model with 2851M total params."
    assert lines[3] == "  per CPU  |  per GPU |   Options"
    # offload: host P * max(4 * 16, 16) * 1.5, device 2P; no offload: host 4P * 8 * 1.5, device 2P + 18P / 16
    gib = 2**30
    assert lines[4] == f" {T5_3B * 64 * 1.5 / gib:7.2f}GB | {2 * T5_3B / gib:6.2f}GB | offload_optimizer=cpu "
    assert (
        lines[5] == f" {T5_3B * 48 / gib:7.2f}GB | {(2 * T5_3B + int(18 * T5_3B / 16)) / gib:6.2f}GB | "
        "offload_optimizer=none"
    )


@pytest.mark.parametrize(
    ("offload", "gpus", "nodes", "expected"),
    [
        (True, 1, 1, (int(1000 * 16 * 1.5), 2000)),  # max(4N, 16) = 16 for small N
        (True, 8, 4, (int(1000 * 128 * 1.5), 2000)),  # 4N = 128 wins
        (False, 4, 1, (int(1000 * 4 * 4 * 1.5), 2000 + 4500)),
    ],
)
def test_zero2_formula(offload: bool, gpus: int, nodes: int, expected: tuple[int, int]) -> None:
    assert ds_zero.estimate_zero2_model_states_mem_needs(1000, gpus, nodes, cpu_offload=offload) == expected


def test_zero3_formula_without_zero_init_takes_the_per_rank_load() -> None:
    host, device, largest = ds_zero.estimate_zero3_model_states_mem_needs(
        1000,
        100,
        num_gpus_per_node=8,
        num_nodes=1,
        cpu_offload=True,
        cpu_offload_params=True,
        zero_init=False,
        additional_buffer_factor=1.0,
    )
    assert (host, device, largest) == (1000 * 32, 400, 400)  # max(4 * 8, 18) bytes per param
    host, device, _ = ds_zero.estimate_zero3_model_states_mem_needs(
        1000, 100, 2, 2, cpu_offload=False, additional_buffer_factor=1.0
    )
    assert (host, device) == (100 * 4 * 2, 400 + 18 * 1000 // 4)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.mid = nn.Linear(8, 30)  # 270 params: smaller than the embedding
        self.head = nn.Linear(8, 50, bias=False)
        self.head.weight = self.emb.weight  # shared: counted once


def test_live_counts_shared_params_once_and_takes_the_largest_module(capsys: pytest.CaptureFixture[str]) -> None:
    model = _Tied()
    assert ds_zero.model_to_params(model) == (400 + 8 * 30 + 30, 400)  # the embedding is the largest module
    live = ds_zero.estimate_zero3_model_states_mem_needs_all_live(model)
    assert live == ds_zero.estimate_zero3_model_states_mem_needs_all_cold(670, 400)
    assert ds_zero.estimate_zero2_model_states_mem_needs_all_live(
        model, num_gpus_per_node=2
    ) == ds_zero.estimate_zero2_model_states_mem_needs_all_cold(670, num_gpus_per_node=2)


def test_live_counts_a_partitioned_model_by_its_full_shapes() -> None:
    with ds_zero.Init():
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 4))
    assert all(p.numel() == 0 or p.ds_numel for p in model.parameters())
    assert ds_zero.model_to_params(model) == (16 * 16 + 16 + 16 * 4 + 4, 16 * 16 + 16)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"num_gpus_per_node": 0}, "num_gpus_per_node"),
        ({"num_nodes": 1.5}, "num_nodes"),
        ({"additional_buffer_factor": 0}, "additional_buffer_factor"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        ds_zero.estimate_zero2_model_states_mem_needs(10, **kwargs)
