"""The fp32 engine on one rank: bit-exact against a plain torch loop, accumulation, clipping, scheduling, API."""

from __future__ import annotations

import math

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

import ds_engine
from ds_comm import UsageError


def _plain_torch(steps: int, batch: int) -> tuple[list[float], torch.Tensor]:
    model = tiny_net(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(steps, batch):
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, flat_params(model)


def test_one_rank_fp32_reproduces_plain_torch_bit_exactly() -> None:
    ref_losses, ref_params = _plain_torch(12, 4)
    model = tiny_net(0)
    engine = make_engine(model, base_config())
    assert type(engine.optimizer) is torch.optim.AdamW  # fp32 stage 0: the base optimizer itself, as DeepSpeed
    losses = []
    for x, y in batches(12, 4):
        loss = loss_fn(engine(x), y)
        assert engine.backward(loss) is loss
        engine.step()
        losses.append(loss.item())
    assert losses == ref_losses
    assert torch.equal(flat_params(model), ref_params)
    assert (engine.global_steps, engine.micro_steps, engine.global_samples, engine.skipped_steps) == (12, 12, 48, 0)
    assert engine.get_global_grad_norm() is None  # no clipping: not computed, as DeepSpeed


def test_accumulation_4x2_matches_1x8_on_the_same_samples() -> None:
    data = batches(6, 8)
    big = tiny_net(0)
    e_big = make_engine(big, base_config(train_micro_batch_size_per_gpu=8))
    small = tiny_net(0)
    e_small = make_engine(small, base_config(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4))
    assert e_small.train_batch_size() == 8 and e_small.gradient_accumulation_steps() == 4
    for x, y in data:
        e_big.backward(loss_fn(e_big(x), y))
        e_big.step()
        for i in range(4):
            assert e_small.is_gradient_accumulation_boundary() == (i == 3)
            e_small.backward(loss_fn(e_small(x[2 * i : 2 * i + 2]), y[2 * i : 2 * i + 2]))
            e_small.step()
            assert e_small.was_step_applied() == (i == 3)
    torch.testing.assert_close(flat_params(small), flat_params(big), rtol=1e-6, atol=1e-6)
    assert (e_small.global_steps, e_small.micro_steps, e_small.global_samples) == (6, 24, 48)


def test_unmanaged_accumulation_steps_on_every_call() -> None:
    data = batches(4, 4)
    managed_model, unmanaged_model = tiny_net(0), tiny_net(0)
    managed = make_engine(managed_model, base_config(gradient_accumulation_steps=2))
    unmanaged = make_engine(
        unmanaged_model, base_config(gradient_accumulation_steps=2, managed_gradient_accumulation=False)
    )
    for i, (x, y) in enumerate(data):
        managed.backward(loss_fn(managed(x), y))
        managed.step()
        unmanaged.backward(loss_fn(unmanaged(x), y))
        if i % 2 == 1:
            assert unmanaged.is_gradient_accumulation_boundary()
            unmanaged.step()
    assert torch.equal(flat_params(managed_model), flat_params(unmanaged_model))
    assert unmanaged.global_steps == 2 and managed.global_steps == 2
    # the caller owns the boundary: overriding it is refused (also an AssertionError, as DeepSpeed asserts)
    with pytest.raises(AssertionError, match="set_gradient_accumulation_boundary.*managed_gradient_accumulation=false"):
        unmanaged.set_gradient_accumulation_boundary(True)


def test_clipping_by_global_norm_matches_the_formula() -> None:
    data = batches(5, 4)
    ref = tiny_net(0)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    norms = []
    for x, y in data:
        opt.zero_grad()
        loss_fn(ref(x), y).backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
        norms.append(norm)
        coef = 0.05 / (norm + 1e-6)
        if coef < 1:
            for p in ref.parameters():
                p.grad.mul_(coef)
        opt.step()
    model = tiny_net(0)
    engine = make_engine(model, base_config(gradient_clipping=0.05, optimizer={"type": "SGD", "params": {"lr": 0.1}}))
    for (x, y), norm in zip(data, norms, strict=True):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
        assert engine.get_global_grad_norm() == pytest.approx(norm, rel=1e-5)
    torch.testing.assert_close(flat_params(model), flat_params(ref), rtol=1e-6, atol=1e-7)


def test_client_optimizer_scheduler_callable_and_boundary_stepping() -> None:
    model = tiny_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    engine, optimizer, loader, sched = ds_engine.initialize(
        model=model,
        optimizer=opt,
        lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5),
        config=base_config(gradient_accumulation_steps=2, optimizer=None),
        dist_init_required=False,
    )
    assert optimizer is opt and loader is None and isinstance(sched, torch.optim.lr_scheduler.StepLR)
    for x, y in batches(4, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert engine.get_lr() == [0.25]  # two boundaries in four micro steps


def test_optimizer_callable_gets_param_groups() -> None:
    seen = {}

    def factory(groups):
        seen["groups"] = groups
        return torch.optim.SGD(groups, lr=0.5)

    model = tiny_net(0)
    groups = [
        {"params": [model.l1.weight, model.l1.bias], "lr": 0.1},
        {"params": list(model.l2.parameters())},
        {"params": []},
    ]
    engine = make_engine(model, base_config(optimizer=None), optimizer=factory, model_parameters=groups)
    assert len(seen["groups"]) == 2 and engine.get_lr() == [0.1, 0.5]


def test_queries_passthrough_and_batch_changes() -> None:
    model = tiny_net(0)
    engine = make_engine(model, base_config(gradient_accumulation_steps=2, steps_per_print=10))
    assert engine.l1 is model.l1 and engine.module is model
    assert (engine.local_rank, engine.global_rank, engine.world_size, engine.dp_world_size) == (0, 0, 1, 1)
    assert engine.get_batch_info() == (8, 4, 2)
    assert (
        engine.zero_optimization(),
        engine.zero_optimization_stage(),
        engine.fp16_enabled(),
        engine.bfloat16_enabled(),
        engine.gradient_clipping(),
        engine.steps_per_print(),
    ) == (False, 0, False, False, 0.0, 10)
    assert engine.optimizer_name() == "adamw" and engine.get_mom() == [(0.9, 0.999)]
    assert engine.config["gradient_accumulation_steps"] == 2
    engine.set_train_batch_size(16)
    assert (engine.train_batch_size(), engine.gradient_accumulation_steps()) == (16, 4)
    with pytest.raises(ValueError, match="Train batch size must be divisible by micro-batch data parallelism: 6"):
        engine.set_train_batch_size(6)
    engine.set_train_micro_batch_size(2)
    assert engine.get_batch_info() == (8, 2, 4)
    assert engine.eval() is engine and not model.training
    engine.train()
    assert model.training


def test_backward_and_step_misuse_are_clear_errors() -> None:
    engine = make_engine(tiny_net(0), base_config())
    x, y = batches(1, 4)[0]
    scalar = r"loss must be a scalar tensor \(one element\) that requires grad, got Tensor of shape \(4, 4\)"
    with pytest.raises(ValueError, match=r"engine.backward\(loss\): " + scalar):
        engine.backward(engine(x))
    with pytest.raises(ValueError, match="requires_grad=False"):
        engine.backward(torch.tensor(1.0))
    # scale() too, as an AssertionError as well (DeepSpeed asserts it), before anything is scaled
    with pytest.raises(AssertionError, match=r"engine.scale\(loss\): " + scalar):
        engine.scale(engine(x))
    with engine.no_sync():
        engine.backward(loss_fn(engine(x), y))
        with pytest.raises(
            UsageError,
            match=r"illegal to call Engine.step\(\) inside no_sync context manager \(here engine.no_sync\(\)\)",
        ):
            engine.step()
        with (
            pytest.raises(
                UsageError, match=r"inside engine.no_sync\(\): no_sync context manager reentry is unsupported"
            ),
            engine.no_sync(),
        ):
            pass
        # DeepSpeed's own test matches "nested" for coalesce_grad_reduction() inside no_sync()
        with pytest.raises(UsageError, match="nested"), engine.coalesce_grad_reduction():
            pass
    engine.step()
    no_opt = make_engine(tiny_net(0), base_config(optimizer=None))
    assert no_opt.optimizer is None
    with pytest.raises(RuntimeError, match="needs an optimizer"):
        no_opt.backward(loss_fn(no_opt(x), y))


def test_zero_grad_by_the_script_is_respected() -> None:
    # A script calling optimizer.zero_grad() (grads -> None) must not break the flat gradient views.
    ref_losses, ref_params = _plain_torch(5, 4)
    model = tiny_net(0)
    engine = make_engine(model, base_config())
    for x, y in batches(5, 4):
        engine.optimizer.zero_grad()
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert torch.equal(flat_params(model), ref_params)


def test_deepspeed_io_shards_with_the_micro_batch() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(20.0).unsqueeze(1))
    model = tiny_net(0)
    engine, _, loader, _ = ds_engine.initialize(
        model=model, config=base_config(), training_data=data, dist_init_required=False
    )
    assert loader is engine.training_dataloader
    sizes = [len(b[0]) for b in loader]
    assert sizes == [4, 4, 4, 4, 4]
    eval_loader = engine.deepspeed_io(data, route="eval", batch_size=8)
    assert [len(b[0]) for b in eval_loader] == [8, 8, 4]
    with pytest.raises(ValueError, match="route must be"):
        engine.deepspeed_io(data, route="bogus")


def test_scale_for_a_manual_backward_matches_engine_backward() -> None:
    data = batches(4, 4)
    a, b = tiny_net(0), tiny_net(0)
    ea = make_engine(a, base_config(gradient_accumulation_steps=2, fp16={"enabled": True, "loss_scale": 8}))
    eb = make_engine(b, base_config(gradient_accumulation_steps=2, fp16={"enabled": True, "loss_scale": 8}))
    for x, y in data:
        ea.backward(loss_fn(ea(x.half()), y))
        ea.step()
        eb.scale(loss_fn(eb(x.half()), y)).backward()
        eb.step()
    assert torch.equal(flat_params(a), flat_params(b)) and eb.global_steps == 2


def test_boundary_override_is_deepspeeds_attribute_until_the_step() -> None:
    """`set_gradient_accumulation_boundary` stores its override under DeepSpeed's attribute name (its tests and
    some trainers read `engine._is_gradient_accumulation_boundary`); the step consumes it."""
    engine = make_engine(tiny_net(0), base_config(gradient_accumulation_steps=2))
    assert engine._is_gradient_accumulation_boundary is None
    assert not engine.is_gradient_accumulation_boundary()  # first of 2 micro steps
    engine.set_gradient_accumulation_boundary(True)
    assert engine._is_gradient_accumulation_boundary is True and engine.is_gradient_accumulation_boundary()
    x, y = batches(1, 4)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    assert engine._is_gradient_accumulation_boundary is None and engine.global_steps == 1
