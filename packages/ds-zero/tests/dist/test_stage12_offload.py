"""Optimizer offload (`offload_optimizer.device="cpu"`): the fp32 master partition, gradient partition and
optimizer state live in separate host buffers (not the model's flat buffer), the step runs there, and the
losses match the same run without offload."""

from __future__ import annotations

import pytest
import torch
from zero_dist_cases import flat_params, make_model, param_groups, train_zero, zero_config

import ds_zero
from ds_comm.testing import run_ranks


def _cpu_adam_class() -> type:
    ds_ops = pytest.importorskip("ds_ops")
    cls = getattr(ds_ops, "DeepSpeedCPUAdam", None)
    if cls is None:
        pytest.skip("needs ds_ops.DeepSpeedCPUAdam (the ds-ops CPU optimizers)")
    return cls


def _run(rank: int, world: int, stage: int, dtype: torch.dtype, offload: bool, cpu_adam: bool) -> dict:
    model = make_model(dtype=dtype)
    if cpu_adam:
        import ds_ops

        base = ds_ops.DeepSpeedCPUAdam(param_groups(model), betas=(0.9, 0.99), adamw_mode=True)
    else:
        base = torch.optim.AdamW(param_groups(model), betas=(0.9, 0.99), foreach=False)
    config = zero_config(stage, offload_optimizer={"device": "cpu" if offload else "none"})
    opt = ds_zero.DeepSpeedZeroOptimizer(base, config=config, module=model, clip_grad=0.05)
    losses = train_zero(opt, model, rank, world, range(8), gas=2, global_loss=False)
    flat_ptrs = {f.flat.untyped_storage().data_ptr() for f in opt.flats}
    state = [v for s in opt.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    info = {
        "losses": losses,
        "params": flat_params(model),
        "offload": opt.offload,
        "masters_separate": all(m.untyped_storage().data_ptr() not in flat_ptrs for m in opt.masters),
        "masters_on_cpu": all(m.device.type == "cpu" and m.dtype == torch.float32 for m in opt.masters),
        "state_on_cpu": bool(state) and all(t.device.type == "cpu" for t in state),
        "stepped_params_are_masters": all(
            g["params"][0] is m for g, m in zip(opt.param_groups, opt.masters, strict=True)
        ),
        "grads_on_cpu": all(g.device.type == "cpu" and g.dtype == torch.float32 for g in opt.grad_partitions),
        "in_pass_copy": opt._updater.in_pass_copy,
    }
    opt.close()
    return info


def _offload_vs_not(rank: int, world: int, cpu_adam: bool) -> dict:
    out = {}
    for stage in (1, 2):
        for dtype in (torch.float32, torch.bfloat16):
            out[(stage, str(dtype), False)] = _run(rank, world, stage, dtype, False, False)
            out[(stage, str(dtype), True)] = _run(rank, world, stage, dtype, True, cpu_adam)
    return out


def _check(results: list[dict], tol: float, in_pass_copy: bool) -> None:
    for rank, per in enumerate(results):
        for (stage, dtype, offload), info in per.items():
            if not offload:
                continue
            where = f"rank {rank} stage {stage} {dtype}"
            ref = per[(stage, dtype, False)]
            assert info["offload"] and info["masters_separate"] and info["masters_on_cpu"], where
            assert info["state_on_cpu"] and info["stepped_params_are_masters"] and info["grads_on_cpu"], where
            assert info["in_pass_copy"] == in_pass_copy, where
            err = max(abs(a - b) for a, b in zip(info["losses"], ref["losses"], strict=True))
            assert err <= tol, f"{where}: offload losses differ by {err}"
            assert float((info["params"] - ref["params"]).abs().max()) <= tol, where


def test_offload_matches_no_offload_with_torch_adamw() -> None:
    # same optimizer math on host buffers: identical results
    _check(run_ranks(2, _offload_vs_not, cpu_adam=False, timeout_s=120), tol=1e-6, in_pass_copy=False)


def test_offload_with_deepspeed_cpu_adam() -> None:
    _cpu_adam_class()
    # DeepSpeedCPUAdam (vectorized, in-pass copy to 16-bit) vs torch AdamW without offload
    _check(run_ranks(2, _offload_vs_not, cpu_adam=True, timeout_s=120), tol=1e-4, in_pass_copy=True)
