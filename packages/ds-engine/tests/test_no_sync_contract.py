"""`engine.no_sync()`: DeepSpeed's refusals (with its wording inside ds's messages), and the stage-0 fp16/bf16
gradient `safe_get_full_grad` reads inside it.

With bf16 at stage 0 each backward moves the 16-bit gradients into an fp32 accumulation buffer and frees
`.grad`; `safe_get_full_grad` must read that buffer (it returned None before). Compared exactly with a
plain torch copy of the bf16 module whose `.grad`s are summed in fp32 after each backward.
"""

from __future__ import annotations

import copy

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

from ds_comm import UsageError
from ds_engine.utils import safe_get_full_grad, safe_set_full_grad, safe_update_full_grad_vectorized


def test_no_sync_under_zero_2_names_the_incompatibility() -> None:
    pytest.importorskip("ds_zero")
    engine = make_engine(tiny_net(0), base_config(zero_optimization={"stage": 2}))
    with pytest.raises(UsageError, match="no_sync context manager is incompatible with ZeRO stage 2") as info:
        with engine.no_sync():
            pass
    assert isinstance(info.value, AssertionError)  # what DeepSpeed's callers catch
    assert not engine.inside_no_sync_ctxt


@pytest.mark.parametrize("accum", ["fp32", None], ids=["fp32_accumulation", "bf16_accumulation"])
def test_bf16_stage0_full_grad_inside_no_sync(accum: str | None) -> None:
    cfg = base_config(bf16={"enabled": True})
    if accum is not None:
        cfg["data_types"] = {"grad_accum_dtype": accum}
    model = tiny_net(0)
    engine = make_engine(model, cfg)
    # unset means the model's dtype (DeepSpeed's default): the bf16 gradients accumulate in .grad
    assert (engine.optimizer.accum is engine.optimizer.master_grads) == (accum == "fp32")
    reference = copy.deepcopy(engine.module)  # the same bf16 weights
    ref_sums = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in reference.named_parameters()}
    data = batches(3, 4, seed=5)

    def window() -> dict[str, torch.Tensor]:
        with engine.no_sync():
            for x, y in data:
                engine.backward(loss_fn(engine(x.bfloat16()), y.bfloat16()).float())
        return {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}

    first = window()
    for x, y in data:
        loss_fn(reference(x.bfloat16()), y.bfloat16()).float().backward()
        for n, p in reference.named_parameters():
            if accum == "fp32":  # moved into fp32 after every backward
                ref_sums[n] += p.grad.float()
                p.grad = None
    if accum != "fp32":  # summed in bf16 by autograd, read once in fp32
        ref_sums = {n: p.grad.float() for n, p in reference.named_parameters()}
    for name, value in first.items():
        assert value is not None and value.dtype == torch.float32, name
        assert torch.equal(value, ref_sums[name]), name

    engine.zero_grad()
    second = window()
    assert all(torch.equal(first[n], second[n]) for n in first)

    weight = engine.module.l1.weight
    safe_set_full_grad(weight, torch.full_like(first["l1.weight"], 0.5))
    assert torch.equal(safe_get_full_grad(weight), torch.full_like(first["l1.weight"], 0.5))
    safe_update_full_grad_vectorized([weight], lambda grad, param: grad * 4)
    assert torch.equal(safe_get_full_grad(weight), torch.full_like(first["l1.weight"], 2.0))
