"""PipelineEngine on gloo: 2 stages and 2 pipes x 2 replicas against a plain PyTorch run, ZeRO-1, checkpoints.

The model has a weight tied between the first and the last stage, so the pipeline-wide gradient
clipping (which must count the tied weight once) is checked too. Every comparison is against the
same model trained sequentially in one process on the same data, to 1e-6 in fp32.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ds_comm.testing import run_ranks

pytest.importorskip("ds_pipe")

D, H, OUT, ROWS, GAS, STEPS, BASE_SEED = 8, 12, 4, 3, 2, 3, 1234
BOUNDS = {1: [0, 6], 2: [0, 3, 6], 4: [0, 2, 4, 5, 6]}
LR = 1e-2


def _tied_out(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, module.weight.t())


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out.float(), y)


def _pipe_model(stages: int, dp: int) -> Any:
    from ds_pipe import LayerSpec, PipeDataParallelTopology, PipelineModule, TiedLayerSpec

    layers = [
        TiedLayerSpec("tie", nn.Linear, D, D, bias=False),
        LayerSpec(nn.Linear, D, H),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, H, D),
        TiedLayerSpec("tie", nn.Linear, D, D, bias=False, forward_fn=_tied_out),
        LayerSpec(nn.Linear, D, OUT),
    ]
    return PipelineModule(
        layers,
        topology=PipeDataParallelTopology(num_pp=stages, num_dp=dp),
        loss_fn=_mse,
        seed_layers=True,
        base_seed=BASE_SEED,
        partition_method=BOUNDS[stages],
    )


class _Reference(nn.Module):
    """The same layers, built with the same per-layer seeds (PipelineModule's seed_layers)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(BASE_SEED + 0)
        self.tie = nn.Linear(D, D, bias=False)
        torch.manual_seed(BASE_SEED + 1)
        self.l1 = nn.Linear(D, H)
        torch.manual_seed(BASE_SEED + 3)
        self.l3 = nn.Linear(H, D)
        torch.manual_seed(BASE_SEED + 5)
        self.l5 = nn.Linear(D, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l5(_tied_out(self.tie, self.l3(torch.tanh(self.l1(self.tie(x))))))


def _ref_key(pipe_key: str) -> str:
    if pipe_key.startswith("tied_modules.tie."):
        return "tie." + pipe_key.rsplit(".", 1)[1]
    idx, name = pipe_key.split(".", 1)
    return f"l{idx}.{name}"


def _micro_batch(step: int, replica: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 * step + 100 * replica + k)
    return torch.randn(ROWS, D, generator=g), torch.randn(ROWS, OUT, generator=g)


def _data(step: int, replica: int) -> Any:
    return iter([_micro_batch(step, replica, k) for k in range(GAS)])


def _schedule(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))


def _config(clip: float, zero: int = 0, **extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}},
        "zero_optimization": {"stage": zero},
        **extra,
    }


def _engine(stages: int, dp: int, config: dict[str, Any]) -> Any:
    import ds_engine

    engine, *_ = ds_engine.initialize(
        model=_pipe_model(stages, dp), config=copy.deepcopy(config), lr_scheduler=_schedule
    )
    return engine


def _eval(engine: Any) -> float:
    return float(engine.eval_batch(_data(99, engine.get_data_parallel_rank())))


def _eval_same_data(engine: Any) -> float:
    """The eval loss on replica 0's data on every replica: the same number whatever the layout."""
    return float(engine.eval_batch(_data(99, 0)))


def _params(engine: Any) -> dict[str, torch.Tensor]:
    return {_ref_key(k): v.detach().float().clone() for k, v in engine.module.state_dict().items()}


def _train(engine: Any, steps: range) -> list[float]:
    return [float(engine.train_batch(_data(s, engine.get_data_parallel_rank()))) for s in steps]


def _reference(num_dp: int, clip: float, steps: int = STEPS) -> dict[str, Any]:
    model = _Reference()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    sched = _schedule(opt)
    losses = []
    for step in range(steps):
        batch = [_micro_batch(step, r, k) for r in range(num_dp) for k in range(GAS)]
        micro = [_mse(model(x), y) for x, y in batch]
        loss = torch.stack(micro).mean()
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
        sched.step()
        losses.append(loss.item())
    with torch.no_grad():
        evals = [_mse(model(x), y) for r in range(num_dp) for x, y in _data(99, r)]
    return {
        "losses": losses,
        "params": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "eval": float(torch.stack(evals).mean()),
    }


def _check(result: dict[str, Any], ref: dict[str, Any]) -> None:
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(ref["losses"]), rtol=1e-6, atol=1e-6)
    assert result["params"], "a stage returned no parameters"
    for key, value in result["params"].items():
        torch.testing.assert_close(value, ref["params"][key], rtol=1e-6, atol=1e-6, msg=key)
    assert result["eval"] == pytest.approx(ref["eval"], rel=1e-6, abs=1e-6)


# ---------------------------------------------------------------------------------------------------------
def _two_stages(rank: int, world: int) -> dict[str, Any]:
    import ds_engine
    import ds_pipe

    engine = _engine(2, 1, _config(clip=0.05))
    out: dict[str, Any] = {
        "type": type(engine).__name__,
        "first": engine.is_first_stage(),
        "last": engine.is_last_stage(),
        "stage": engine.get_pipeline_parallel_rank(),
    }
    out["losses"] = _train(engine, range(STEPS))
    out["params"], out["eval"] = _params(engine), _eval(engine)
    out["counters"] = (engine.global_steps, engine.global_samples, engine.micro_steps)
    out["lr"] = engine.get_lr()
    out["norm"] = engine.get_global_grad_norm()
    errors = []
    for call in (lambda: engine(torch.zeros(ROWS, D)), lambda: engine.backward(torch.zeros(())), engine.step):
        try:
            call()
        except ds_pipe.PipelineError as err:
            errors.append((str(err), isinstance(err, ds_engine.PipelineError)))
    out["errors"] = errors
    with torch.no_grad():
        try:
            engine.train_batch(_data(0, 0))
        except RuntimeError as err:
            out["no_grad"] = str(err)
    engine.set_train_batch_size(ROWS * 4)
    out["gas_after"] = engine.gradient_accumulation_steps()
    bf16 = _engine(2, 1, _config(clip=0.0, bf16={"enabled": True}))
    out["bf16_losses"] = _train(bf16, range(STEPS))
    out["bf16_dtype"] = next(bf16.module.parameters()).dtype
    return out


def test_two_stages_match_sequential_pytorch() -> None:
    results = run_ranks(2, _two_stages, timeout_s=120)
    ref = _reference(1, clip=0.05)
    merged = {**results[0]["params"], **results[1]["params"]}
    assert set(merged) == set(ref["params"])
    for r in results:
        _check({**r, "params": r["params"]}, ref)
        assert r["type"] == "PipelineEngine"
        assert r["counters"] == (STEPS, STEPS * ROWS * GAS, STEPS * GAS)
        assert r["lr"] == pytest.approx([LR / (1 + STEPS)])
        assert r["errors"] == [("Only train_batch() is accessible in pipeline mode.", True)] * 3
        assert "requires gradients enabled" in r["no_grad"]
        assert r["gas_after"] == 4
        assert r["bf16_dtype"] == torch.bfloat16
        torch.testing.assert_close(
            torch.tensor(r["bf16_losses"]), torch.tensor(_reference(1, 0.0)["losses"]), rtol=3e-2, atol=3e-2
        )
    assert [(r["first"], r["last"], r["stage"]) for r in results] == [(True, False, 0), (False, True, 1)]
    assert results[0]["norm"] == pytest.approx(results[1]["norm"]) and results[0]["norm"] > 0.05  # clipping bit


def _pipes_by_data(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name, zero in (("stage0", 0), ("zero1", 1)):
        engine = _engine(2, 2, _config(clip=0.05, zero=zero))
        losses = _train(engine, range(STEPS))
        out[name] = {
            "losses": losses,
            "params": _params(engine),
            "eval": _eval(engine),
            "optimizer": type(engine.optimizer).__name__,
            "dp": engine.dp_world_size,
        }
    return out


def test_two_pipes_by_two_replicas_match_sequential_pytorch_with_and_without_zero1() -> None:
    results = run_ranks(4, _pipes_by_data, timeout_s=180)
    ref = _reference(2, clip=0.05)
    for r in results:
        _check(r["stage0"], ref)
        _check(r["zero1"], ref)
        assert r["zero1"]["optimizer"] == "DeepSpeedZeroOptimizer" and r["zero1"]["dp"] == 2


def _checkpoints(rank: int, world: int, root: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    engine = _engine(2, 2, _config(clip=0.05))
    _train(engine, range(2))
    engine.save_checkpoint(root, client_state={"mine": 7})
    out["saved_eval"] = _eval_same_data(engine)
    out["continued"] = _train(engine, range(2, 3)) + [_eval_same_data(engine)]
    resumed = _engine(2, 2, _config(clip=0.05))
    path, client = resumed.load_checkpoint(root)
    out["client"] = client["mine"]
    out["resumed_counters"] = (resumed.global_steps, resumed.global_samples)
    out["resumed"] = _train(resumed, range(2, 3)) + [_eval_same_data(resumed)]
    for stages, dp in ((4, 1), (1, 4)):
        other = _engine(stages, dp, _config(clip=0.05))
        try:
            other.load_checkpoint(root)
        except ValueError as err:
            out[f"error_{stages}"] = str(err)
        other.load_checkpoint(root, load_optimizer_states=False)
        out[f"eval_{stages}"] = _eval_same_data(other)
        out[f"steps_{stages}"] = other.global_steps
    return out


def test_checkpoint_reloads_with_other_stage_counts(tmp_path: Path) -> None:
    results = run_ranks(4, _checkpoints, root=str(tmp_path), timeout_s=180)
    names = sorted(p.name for p in (tmp_path / "global_step2").iterdir())
    assert names == [f"layer_{i:02d}-model_states.pt" for i in range(6)] + [
        "mp_rank_00_model_states.pt",
        "mp_rank_01_model_states.pt",
    ]
    assert (tmp_path / "latest").read_text() == "global_step2"
    stage_state = torch.load(tmp_path / "global_step2" / "mp_rank_01_model_states.pt", weights_only=False)
    assert stage_state["module"] is None and stage_state["checkpoint_parallel_dimensions"]["pp_degree"] == 2
    for r in results:
        assert r["client"] == 7 and r["resumed_counters"] == (2, 2 * ROWS * GAS * 2)
        torch.testing.assert_close(torch.tensor(r["resumed"]), torch.tensor(r["continued"]), rtol=0, atol=1e-7)
        for stages in (4, 1):
            assert "saved with 2 pipeline stages" in r[f"error_{stages}"]
            assert "load_optimizer_states=False" in r[f"error_{stages}"]
            assert r[f"eval_{stages}"] == pytest.approx(r["saved_eval"], rel=1e-6, abs=1e-7)
            assert r[f"steps_{stages}"] == 2
