"""`tensor_parallel.partition_config`: regex layer specs decide the AutoTP cuts (DeepSpeed's configurable AutoTP).

A small model with a fused qkv projection (three sub-parameters), a packed gate/up projection (two), a
row-parallel down projection, a linear-like module of the user's (not an `nn.Linear`) cut by columns
with its output gathered, a layer no spec matches (stays whole), and a replicated scalar applied to
sharded activations (a `skip` spec with `grad_allreduce`). Trained with TP=2 it gives the losses and
whole weights of the same model trained alone (fp32, SGD; 1e-5). Without `grad_allreduce` the scalar's
gradient is partial and the run drifts from the reference: the test of the hook fails without it.
Mid-run, DeepSpeed's per-parameter hooks (`p.gather_params([p])`, `p._tp_partition([p])`) give the whole
weight and put the shard back into ZeRO-1's flat buffer, so the later steps still match.

Also `tp_model_init` merged at initialize(): its size fills the config (`engine.autotp_size()`), the
DeepSpeed TP/DP group getters answer afterwards, and a dtype that disagrees with the config, or a
`tp_group` given together with an `mpu`, is a ValueError on every rank before anything is built.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_parallel", reason="AutoTP needs ds-parallel: pip install 'ds-engine[parallel]'")

STEPS = 6
D = 16
SPECS: list[dict[str, Any]] = [
    {"patterns": [r".*\.qkv_proj\.weight$"], "partition_type": "column", "shape": [[D, D, D], -1]},
    {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1], "partition_dim": 0},
    {"patterns": [r".*\.(o_proj|down_proj)\.weight$"], "partition_type": "row"},
    {"patterns": [r"head\.weight$"], "partition_type": "column", "gather_output": True},
    {"patterns": [r".*temperature$"], "partition_type": "skip", "grad_allreduce": True},
]


class CustomHead(nn.Module):
    """Linear-like, but not an `nn.Linear`: a spec may still cut it."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) * 0.2)
        self.bias = nn.Parameter(torch.randn(d_out) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = nn.Linear(D, 3 * D)
        self.o_proj = nn.Linear(D, D)
        self.temperature = nn.Parameter(torch.tensor([1.3]))
        self.gate_up_proj = nn.Linear(D, 4 * D)
        self.down_proj = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv_proj(x).chunk(3, dim=-1)  # each rank: its piece of q, of k and of v
        x = x + self.o_proj(torch.tanh(self.temperature * q) * k + v)
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return x + self.down_proj(torch.nn.functional.silu(gate) * up)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()
        self.extra = nn.Linear(D, D)  # no spec matches: whole on every rank
        self.head = CustomHead(D, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.head(self.extra(self.block(x))), y)


def _kind(module: nn.Module) -> str:
    return type(module).__name__ + ("+gather" if getattr(module, "gather_output", False) else "")


def _train(rank: int, world: int, tp: int, specs: list[dict[str, Any]]) -> dict[str, Any]:
    import ds_engine as deepspeed

    torch.manual_seed(0)
    model = Model()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
    }
    if tp > 1:
        partition = {"use_default_specs": False, "layer_specs": specs}
        config["tensor_parallel"] = {"autotp_size": tp, "partition_config": partition}
    engine, *_ = deepspeed.initialize(model=model, config=config)
    losses = []
    whole = None
    for step in range(STEPS):
        if tp == 1 and step == STEPS // 2:
            whole = model.block.down_proj.weight.detach().clone()
        if tp > 1 and step == STEPS // 2:  # DeepSpeed's per-parameter hooks: whole weight in place, then the shard
            weight = model.block.down_proj.weight
            shard = weight.detach().clone()
            weight.gather_params([weight])
            whole = weight.detach().clone()
            weight._tp_partition([weight])  # back into the ZeRO flat buffer: later steps still update it
            assert torch.equal(weight, shard)
        g = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(4, D, generator=g), torch.randn(4, 8, generator=g)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    block = model.block
    return {
        "whole_down": whole,
        "losses": losses,
        "full": {k: v.clone() for k, v in engine.module_state_dict().items()},
        "kinds": {
            n: _kind(m)
            for n, m in [
                ("qkv", block.qkv_proj),
                ("gate_up", block.gate_up_proj),
                ("down", block.down_proj),
                ("head", model.head),
                ("extra", model.extra),
            ]
        },
        "qkv_shape": tuple(block.qkv_proj.weight.shape),
    }


def _close(results: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(ref["losses"]), rtol=0, atol=1e-5)
        for k, v in ref["full"].items():
            torch.testing.assert_close(r["full"][k], v, rtol=1e-5, atol=1e-5, msg=k)


@pytest.mark.timeout(600)
def test_partition_config_cuts_by_specs_and_trains_like_the_whole_model() -> None:
    (ref,) = run_ranks(1, _train, 1, SPECS, timeout_s=180)
    results = run_ranks(2, _train, 2, SPECS, timeout_s=240)
    _close(results, ref)
    assert results[0]["kinds"] == {
        "qkv": "SubParamLinearLayer",
        "gate_up": "SubParamLinearLayer",
        "down": "LinearAllreduce",
        "head": "LinearLayer+gather",
        "extra": "Linear",
    }
    assert results[0]["qkv_shape"] == (3 * D // 2, D)  # half of each of q, k and v
    for r in results:  # the weight gathered mid-run is the whole model's at that step
        torch.testing.assert_close(r["whole_down"], ref["whole_down"], rtol=1e-5, atol=1e-5)
    # Without grad_allreduce the replicated scalar gets only its shard's gradient, and training drifts.
    partial = [dict(s, grad_allreduce=False) if "temperature" in s["patterns"][0] else s for s in SPECS]
    drifted = run_ranks(2, _train, 2, partial, timeout_s=240)
    with pytest.raises(AssertionError):
        _close(drifted, ref)


def _tp_model_init(rank: int, world: int, case: str) -> dict[str, Any]:
    import ds_engine as deepspeed
    from ds_engine.utils import groups

    torch.manual_seed(0)
    model = Model()
    config: dict[str, Any] = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    if case == "merge":
        deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32)
        partition = {"use_default_specs": False, "layer_specs": SPECS}
        engine, *_ = deepspeed.initialize(
            model=model, config={**config, "tensor_parallel": {"partition_config": partition}}
        )
        return {
            "autotp": engine.autotp_size(),
            "tp": groups.get_tensor_model_parallel_world_size(),
            "dp": groups.get_data_parallel_world_size(),
        }
    try:
        if case == "dtype":
            deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float16)
            deepspeed.initialize(model=model, config={**config, "bf16": {"enabled": True}})
        else:
            deepspeed.tp_model_init(model, tp_size=2, dtype=torch.float32, tp_group=torch.distributed.group.WORLD)
            deepspeed.initialize(model=model, config=config, mpu=object())
    except ValueError as err:
        return {"error": str(err), "cut": any("LinearLayer" in type(m).__name__ for m in model.modules())}
    return {"error": None}


@pytest.mark.timeout(300)
def test_tp_model_init_is_merged_into_the_config() -> None:
    for r in run_ranks(4, _tp_model_init, "merge", timeout_s=180):
        assert r == {"autotp": 2, "tp": 2, "dp": 2}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("dtype", "Conflicting dtype: config uses torch.bfloat16 but tp_model_init requested torch.float16."),
        ("mpu", "tp_model_init provided tp_group; deepspeed.initialize must not receive mpu."),
    ],
)
def test_tp_model_init_conflicts_are_refused_before_anything_is_cut(case: str, message: str) -> None:
    for r in run_ranks(2, _tp_model_init, case, timeout_s=180):
        assert r == {"error": message, "cut": False}
