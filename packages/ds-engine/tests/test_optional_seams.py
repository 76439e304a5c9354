"""The ds-zero and ds-pipe seams: clear errors without them, and the ZeRO call site per the contract.

The contract (`ds_engine._step.zero_contract`) is exercised with a stand-in module that implements its
interface without partitioning; tests/test_zero_contract.py checks ds-zero's real classes against it.
"""

from __future__ import annotations

import sys
import types
import warnings
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

import ds_engine
import ds_ops
from ds_comm import ConfigDeprecationWarning, ConfigModel
from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_ops.precision import LossScaler


@pytest.fixture
def fresh_shims():
    """Drop the `ds_engine.pipe`/`.zero` shims before and after, so they bind to this test's (fake or no) sibling."""

    def drop() -> None:
        for name in ("pipe", "zero", "checkpointing"):
            sys.modules.pop(f"ds_engine.{name}", None)
            ds_engine.__dict__.pop(name, None)

    drop()
    yield
    drop()


@pytest.fixture
def no_ds_zero(monkeypatch, fresh_shims):
    monkeypatch.setitem(sys.modules, "ds_zero", None)  # import ds_zero -> ModuleNotFoundError


def test_stage_2_without_ds_zero_names_the_extra(no_ds_zero) -> None:
    expected = r"zero_optimization.stage=2: ZeRO stage 2 needs ds-zero: pip install 'ds-engine\[zero\]'"
    with pytest.raises(DeepSpeedConfigError, match=expected):
        DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": {"stage": 2}})
    model = tiny_net(0)
    with pytest.raises(DeepSpeedConfigError, match=expected):
        ds_engine.initialize(model=model, config=base_config(zero_optimization={"stage": 2}), dist_init_required=False)
    with (
        pytest.raises(DeepSpeedConfigError, match=r"stage=1: ZeRO stage 1 needs ds-zero"),
        pytest.warns(ConfigDeprecationWarning),
    ):
        DeepSpeedConfig({"train_batch_size": 2, "zero_optimization": True})
    with pytest.raises(ImportError, match=r"needs ds-zero: pip install 'ds-engine\[zero\]'"):
        _ = ds_engine.zero


def test_stage_0_works_without_ds_zero(no_ds_zero, caplog) -> None:
    for zero in (None, False, {"stage": 0}, {"stage": 0, "reduce_bucket_size": 100}):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConfigDeprecationWarning)
            cfg = DeepSpeedConfig({"train_batch_size": 2, **({} if zero is None else {"zero_optimization": zero})})
        assert cfg.zero_optimization_stage == 0 and cfg.zero_config is None
    assert "have no effect at stage 0 and are not validated without ds-zero" in caplog.text


class FakeZeroConfig(ConfigModel):
    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    load_from_fp32_weights: bool = True
    gather_16bit_weights_on_model_save: bool = False
    offload_optimizer: dict[str, Any] | None = None
    offload_param: dict[str, Any] | None = None

    # resolve_zero reads the effective devices (ds-zero's `ZeroConfig` properties of the same names).
    @property
    def offload_optimizer_device(self) -> str:
        return str((self.offload_optimizer or {}).get("device", "none")) if self.stage > 0 else "none"

    @property
    def offload_param_device(self) -> str:
        return str((self.offload_param or {}).get("device", "none"))


class ContractZeroOptimizer:
    """The contract's interface on one rank, without partitioning: enough to check the engine's side."""

    calls: ClassVar[list[tuple[str, Any]]] = []

    def __init__(
        self,
        optimizer,
        *,
        config,
        module=None,
        loss_scaler=None,
        clip_grad=0.0,
        check_overflow=True,
        dp_group=None,
        gradient_predivide_factor=1.0,
        communication_dtype=None,
        gradient_average=True,
    ) -> None:
        self.optimizer = optimizer
        self.kwargs = dict(
            config=config,
            module=module,
            loss_scaler=loss_scaler,
            clip_grad=clip_grad,
            check_overflow=check_overflow,
            dp_group=dp_group,
            gradient_predivide_factor=gradient_predivide_factor,
            communication_dtype=communication_dtype,
            gradient_average=gradient_average,
        )
        self.loss_scaler = loss_scaler or LossScaler(1.0)
        self.global_grad_norm = None
        self.params = [p for g in optimizer.param_groups for p in g["params"]]

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.loss_scale

    def backward(self, loss, retain_graph=False) -> None:
        self.calls.append(("backward", float(loss.detach())))
        self.loss_scaler.scale_loss(loss).backward(retain_graph=retain_graph)

    def step(self, closure=None, *, skip=None) -> bool:
        self.calls.append(("step", None))
        if skip is not None and float(skip) > 0:
            return False
        self.global_grad_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in self.params]))
        self.optimizer.step()
        return True

    def zero_grad(self, set_to_none=True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"base_optimizer_state": self.optimizer.state_dict(), "partition_count": 1, "stage": 2}

    def load_state_dict(self, state_dicts, load_optimizer_states=True, load_from_fp32_weights=True) -> None:
        self.calls.append(("load", (len(state_dicts), load_optimizer_states, load_from_fp32_weights)))
        self.optimizer.load_state_dict(state_dicts[0]["base_optimizer_state"])

    def refresh_fp32_params(self) -> None:
        self.calls.append(("refresh", None))


class ContractStage3(ContractZeroOptimizer):
    pass


def _fake_param_shapes(optimizer: Any, module: torch.nn.Module) -> list[dict[str, list[int]]]:
    names = {id(p): n for n, p in module.named_parameters()}
    return [{names[id(p)]: list(p.shape) for p in g["params"] if id(p) in names} for g in optimizer.param_groups]


def _fake_load_partitions(ckpt_dir: Any, *, mp_rank: int = 0) -> list[dict[str, Any]]:
    files = sorted(Path(ckpt_dir).glob(f"zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt"))
    return [torch.load(f, weights_only=False)["optimizer_state_dict"] for f in files]


def _fake_shared_param_names(module: torch.nn.Module) -> dict[str, str]:
    """Each later name of a parameter object -> its first name (DeepSpeed's `shared_params`)."""
    first: dict[int, str] = {}
    shared = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            shared[name] = first[id(p)]
        else:
            first[id(p)] = name
    return shared


def _fake_frozen_fields(
    module_state: dict[str, torch.Tensor], frozen: list[str], *, stage: int, **_: Any
) -> tuple[dict[str, torch.Size] | None, dict[str, torch.Tensor] | None]:
    """The frozen parameters' shapes and whole values from stage 2 on (None below, as DeepSpeed writes them)."""
    if stage < 2:
        return None, None
    return {n: module_state[n].shape for n in frozen}, {n: module_state[n] for n in frozen}


def _fake_ds_zero(with_optimizers: bool) -> types.ModuleType:
    module = types.ModuleType("ds_zero")
    module.__version__ = "0.1.0"

    module.ZeroConfig = FakeZeroConfig
    # The module-level checkpoint helpers the engine calls (see `_zero_contract`), in their simplest form.
    module.zero_param_shapes = _fake_param_shapes
    module.load_partition_state_dicts = _fake_load_partitions
    module.shared_param_names = _fake_shared_param_names
    module.frozen_fields = _fake_frozen_fields
    module.copy_recovery_scripts = lambda save_dir: None
    if with_optimizers:
        module.DeepSpeedZeroOptimizer = ContractZeroOptimizer
        module.DeepSpeedZeroOptimizer_Stage3 = ContractStage3
    return module


def test_missing_zero_optimizer_class_is_a_clear_import_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ds_zero", _fake_ds_zero(with_optimizers=False))
    with pytest.raises(
        ImportError,
        match=r"ZeRO stage 2 needs ds_zero.DeepSpeedZeroOptimizer, which the installed "
        r"ds-zero 0.1.0 does not provide",
    ):
        make_engine(tiny_net(0), base_config(zero_optimization={"stage": 2}))


def test_zero_call_site_training_and_checkpoint_follow_the_contract(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "ds_zero", _fake_ds_zero(with_optimizers=True))
    ContractZeroOptimizer.calls.clear()
    model = tiny_net(0)
    engine, optimizer, _, sched = ds_engine.initialize(
        model=model,
        config=base_config(
            zero_optimization={"stage": 2},
            gradient_clipping=0.5,
            gradient_accumulation_steps=2,
            gradient_predivide_factor=2.0,
            communication_data_type="fp32",
            scheduler={"type": "WarmupLR", "params": {"warmup_num_steps": 5}},
            # ds's layout, whichever default an earlier `import deepspeed` in this process set
            checkpoint={"layout": "ds"},
        ),
        dist_init_required=False,
    )
    assert type(optimizer) is ContractZeroOptimizer and engine.zero_optimization_stage() == 2
    kw = optimizer.kwargs
    assert kw["config"].stage == 2 and kw["module"] is model and kw["clip_grad"] == 0.5 and kw["dp_group"] is None
    assert kw["check_overflow"] is True  # fp32 under ZeRO: steps with inf/nan gradients are skipped
    assert kw["gradient_predivide_factor"] == 2.0 and kw["communication_dtype"] == torch.float32
    assert kw["gradient_average"] is True  # gradient_allreduce_op: "mean", the default
    assert type(kw["loss_scaler"]) is LossScaler and isinstance(optimizer.optimizer, torch.optim.AdamW)
    x, y = batches(1, 4)[0]
    for _ in range(4):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
    # The engine divides by gradient_accumulation_steps before handing the loss over.
    assert ContractZeroOptimizer.calls[0] == ("backward", pytest.approx(loss.item() / 2, rel=1e-5))
    assert [c for c, _ in ContractZeroOptimizer.calls].count("step") == 2
    assert sched.last_batch_iteration == 1 and isinstance(engine.get_global_grad_norm(), float)

    engine.save_checkpoint(str(tmp_path), tag="z")
    files = sorted(p.name for p in (tmp_path / "z").iterdir())
    assert files == ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    zero_file = torch.load(tmp_path / "z" / files[1], weights_only=False)
    assert set(zero_file) == {"optimizer_state_dict", "ds_config", "ds_version"}
    model_file = torch.load(tmp_path / "z" / files[0], weights_only=False)
    assert model_file["optimizer"] is None and list(model_file["param_shapes"][0]) == [
        "l1.weight",
        "l1.bias",
        "l2.weight",
        "l2.bias",
    ]
    fresh_model = tiny_net(9)
    fresh = make_engine(fresh_model, base_config(zero_optimization={"stage": 2}))
    fresh.load_checkpoint(str(tmp_path))
    assert ContractZeroOptimizer.calls[-1] == ("load", (1, True, True))
    assert torch.equal(flat_params(fresh_model), flat_params(model)) and fresh.global_steps == 2

    stage3 = make_engine(tiny_net(0), base_config(zero_optimization={"stage": 3}))
    assert type(stage3.optimizer) is ContractStage3
    assert stage3.save_16bit_model(str(tmp_path / "s3")) is False  # gather flag off, as DeepSpeed


def test_zero_offload_builds_the_cpu_optimizer(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ds_zero", _fake_ds_zero(with_optimizers=True))

    class CPUAdam(torch.optim.AdamW):
        def __init__(
            self,
            params,
            lr=1e-3,
            bias_correction=True,
            betas=(0.9, 0.999),
            eps=1e-8,
            weight_decay=0,
            amsgrad=False,
            adamw_mode=True,
            fp32_optimizer_states=True,
        ):
            super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)

    CPUAdam.__name__ = "DeepSpeedCPUAdam"
    monkeypatch.setattr(ds_ops, "DeepSpeedCPUAdam", CPUAdam, raising=False)
    engine = make_engine(
        tiny_net(0),
        base_config(
            zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
            optimizer={"type": "AdamW", "params": {"lr": 0.1, "torch_adam": False}},
        ),
    )
    assert type(engine.optimizer.optimizer) is CPUAdam and engine.zero_cpu_offload()
    with pytest.raises(DeepSpeedConfigError, match="has no DeepSpeed CPU implementation for offload_optimizer"):
        make_engine(
            tiny_net(0),
            base_config(
                zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}},
                optimizer={"type": "SGD", "params": {"lr": 0.1}},
                zero_allow_untested_optimizer=True,
            ),
        )


def test_pipeline_module_reaches_the_pipeline_seam(monkeypatch, fresh_shims) -> None:
    fake = types.ModuleType("ds_pipe")

    class PipelineModule(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

    PipelineModule.__module__ = "ds_pipe"
    fake.PipelineModule = PipelineModule
    monkeypatch.setitem(sys.modules, "ds_pipe", fake)
    assert ds_engine.PipelineModule is PipelineModule and ds_engine.pipe.PipelineModule is PipelineModule
    with pytest.raises(ValueError, match="mpu must be None for a PipelineModule"):
        ds_engine.initialize(model=PipelineModule(), config=base_config(), mpu=object(), dist_init_required=False)
    monkeypatch.setitem(sys.modules, "ds_pipe", None)
    with pytest.raises(ImportError, match=r"deepspeed.PipelineModule needs ds-pipe"):
        _ = ds_engine.PipelineModule
    with pytest.raises(ImportError, match=r"needs ds-pipe: pip install 'ds-engine\[pipe\]'"):
        ds_engine.initialize(model=PipelineModule(), config=base_config(), dist_init_required=False)


def test_pipe_sections_without_ds_pipe_name_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "ds_pipe", None)
    cfg = DeepSpeedConfig({"train_batch_size": 2})  # no pipe section: ds-pipe is not needed
    for section in ("pipeline", "activation_checkpointing"):
        with pytest.raises(
            DeepSpeedConfigError,
            match=rf"{section}: the '{section}' config section needs ds-pipe: "
            r"pip install 'ds-engine\[pipe\]'",
        ):
            DeepSpeedConfig({"train_batch_size": 2, section: {}})
        with pytest.raises(DeepSpeedConfigError, match=r"needs ds-pipe"):
            getattr(cfg, section)
