"""PipelineEngine in one process (one stage): config checks before any work, and the pipeline sections."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ds_engine
from ds_engine import DeepSpeedConfig, DeepSpeedConfigError

ds_pipe = pytest.importorskip("ds_pipe")


def _model(**kwargs: Any) -> Any:
    torch.manual_seed(0)
    layers = [ds_pipe.LayerSpec(nn.Linear, 4, 8), ds_pipe.LayerSpec(nn.Tanh), ds_pipe.LayerSpec(nn.Linear, 8, 2)]
    return ds_pipe.PipelineModule(layers, num_stages=1, loss_fn=lambda out, y: F.mse_loss(out, y), **kwargs)


def _config(**extra: Any) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        **extra,
    }


def _init(model: Any, config: dict[str, Any]) -> Any:
    engine, *_ = ds_engine.initialize(model=model, config=copy.deepcopy(config), dist_init_required=False)
    return engine


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(2, 4, generator=g), torch.randn(2, 2, generator=g)) for _ in range(n)]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True},
            r"zero_optimization.stage=2: ZeRO-2 and ZeRO-3 are incompatible",
        ),
        ({"pipeline": {"stages": 2}}, r"pipeline.stages=2 but the PipelineModule was built with 1 stages"),
        (
            {"managed_gradient_accumulation": False},
            r"managed_gradient_accumulation=false is not supported with pipeline parallelism",
        ),
        ({"pipeline": {"partition": "best-effort"}}, r"pipeline.partition: .*unknown partition method"),
        (
            {"activation_checkpointing": {"contiguous_memory_optimization": True}},
            r"activation_checkpointing.*number_checkpoints",
        ),
    ],
)
def test_bad_pipeline_configs_fail_before_training(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _init(_model(), _config(**extra))


def test_one_stage_engine_matches_plain_sgd_and_applies_the_pipeline_section() -> None:
    engine = _init(_model(), _config(pipeline={"activation_checkpoint_interval": 1}, gradient_clipping=0.1))
    assert isinstance(engine, ds_engine.PipelineEngine) and engine.pipeline_parallelism
    assert engine.module.activation_checkpoint_interval == 1
    ref = _model()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    data = _batches(4)
    for step in range(2):
        micro = data[2 * step : 2 * step + 2]
        loss = engine.train_batch(iter(micro))
        ref_loss = torch.stack([F.mse_loss(ref(x), y) for x, y in micro]).mean()
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        opt.step()
        opt.zero_grad()
        assert float(loss) == pytest.approx(ref_loss.item(), rel=1e-6)
    for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert engine.global_steps == 2 and engine.micro_steps == 4
    with pytest.raises(ds_engine.PipelineError, match="Only train_batch"):
        engine(torch.zeros(2, 4))
    losses, logits = engine.eval_batch(iter(data[:2]), return_logits=True, reduce_output=None)
    assert len(losses) == 2 and logits[0].shape == (2, 2)


def test_pipe_sections_are_validated_once_at_config_time_by_ds_pipe_models() -> None:
    from ds_engine.config import ActivationCheckpointingConfig, PipelineConfig

    assert PipelineConfig is ds_pipe.PipelineConfig
    assert ActivationCheckpointingConfig is ds_pipe.ActivationCheckpointingConfig
    cfg = DeepSpeedConfig({"train_batch_size": 2, "pipeline": {"partition": "Uniform", "stages": 2}})
    assert isinstance(cfg.pipeline, ds_pipe.PipelineConfig) and cfg.pipeline.partition == "uniform"
    assert cfg.activation_checkpointing == ds_pipe.ActivationCheckpointingConfig()  # absent: ds-pipe's defaults
    auto = DeepSpeedConfig({"train_batch_size": 2, "pipeline": {"stages": "auto"}})
    assert auto.auto_keys == () and auto.pipeline.stages == "auto"  # DeepSpeed's real value, not a placeholder
    # Before, DeepSpeedConfig accepted this and only initialize() refused it.
    with pytest.raises(DeepSpeedConfigError, match=r"pipeline.partition: unknown partition method 'bogus'"):
        DeepSpeedConfig({"train_batch_size": 2, "pipeline": {"partition": "bogus"}})


def test_use_reentrant_false_picks_the_non_reentrant_checkpoint_even_when_off() -> None:
    # With the interval 0 in the config, a later set_checkpoint_interval() must still use the function
    # the config chose.
    engine = _init(_model(), _config(pipeline={"use_reentrant": False}))
    assert engine.module.activation_checkpoint_func is ds_pipe.checkpointing.non_reentrant_checkpoint
    assert not engine._reentrant_activation_checkpointing()
    engine.module.set_checkpoint_interval(1)
    assert engine.module.activation_checkpoint_func is ds_pipe.checkpointing.non_reentrant_checkpoint
    assert not engine._reentrant_activation_checkpointing()
    x, y = _batches(1)[0]
    loss = engine.train_batch(iter([(x, y), (x, y)]))
    assert torch.isfinite(loss)


def test_reentrant_query_follows_the_module_not_the_config() -> None:
    engine = _init(_model(), _config())
    assert engine.module.activation_checkpoint_func is ds_pipe.checkpointing.checkpoint
    assert not engine._reentrant_activation_checkpointing()  # interval 0
    engine.module.set_checkpoint_interval(2)
    assert engine._reentrant_activation_checkpointing()
