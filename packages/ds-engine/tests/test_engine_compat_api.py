"""DeepSpeedEngine's wider surface in one process: backward's return value, set_train_batch_size, the attributes
libraries read, the zero_*/precision getters, offload without an optimizer, compile()."""

from __future__ import annotations

import zipfile as zipfile_module
from pathlib import Path

import pytest
import torch
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net

import ds_engine


def test_backward_returns_the_gas_divided_loss() -> None:
    engine = make_engine(tiny_net(0), base_config(gradient_accumulation_steps=4))
    x, y = batches(1, 4)[0]
    loss = loss_fn(engine(x), y)
    returned = engine.backward(loss)
    assert torch.equal(returned, loss / 4)
    loss = loss_fn(engine(x), y)
    assert engine.backward(loss, scale_wrt_gas=False) is loss


def test_set_train_batch_size_changes_accumulation_steps() -> None:
    engine = make_engine(tiny_net(0), base_config())
    assert engine.get_batch_info() == (4, 4, 1)
    engine.set_train_batch_size(12)
    assert engine.get_batch_info() == (12, 4, 3)
    for x, y in batches(6, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    assert (engine.global_steps, engine.micro_steps, engine.global_samples) == (2, 6, 24)
    with pytest.raises(ValueError, match="Train batch size must be divisible by micro-batch data parallelism"):
        engine.set_train_batch_size(10)
    engine.set_train_micro_batch_size(2)
    assert engine.get_batch_info() == (6, 2, 3)


def test_attributes_libraries_read() -> None:
    model = tiny_net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    data = torch.utils.data.TensorDataset(torch.randn(8, 8), torch.randn(8, 4))
    cfg = base_config(gradient_allreduce_op="sum")
    del cfg["optimizer"]
    engine = make_engine(model, cfg, optimizer=opt, lr_scheduler=sched, training_data=data)
    assert engine.client_optimizer is opt and engine.client_lr_scheduler is sched
    assert engine.training_data is data and engine.mpu is None and engine.collate_fn is None
    assert engine.param_names == {p: n for n, p in model.named_parameters()}
    assert engine.has_moe_layers is False and engine.losses is None and engine.enable_backward_allreduce
    if torch.distributed.is_initialized():  # an earlier test in this process left a one-rank job
        assert engine.data_parallel_group is torch.distributed.group.WORLD
        assert engine.dist_backend == torch.distributed.get_backend()
    else:
        assert engine.data_parallel_group is None and engine.dist_backend is None
    assert engine.sequence_parallel_size == 1 and engine.gradient_average is False
    assert not engine.inside_no_sync_ctxt
    with engine.no_sync():
        assert engine.inside_no_sync_ctxt
    assert engine.is_map_style_dataset(data) and not engine.is_iterable_style_dataset(data)


@pytest.mark.parametrize(
    ("section", "comm", "expected"),
    [({}, None, torch.float32), ({"bf16": {"enabled": True}}, None, torch.bfloat16), ({}, "bf16", torch.bfloat16)],
)
def test_precision_queries(section: dict[str, object], comm: str | None, expected: torch.dtype) -> None:
    """DeepSpeed's `get_data_types()`: gradients accumulate in the model's dtype unless data_types says."""
    cfg = base_config(**section)
    if comm is not None:
        cfg["communication_data_type"] = comm
    engine = make_engine(tiny_net(0), cfg)
    assert engine.communication_data_type == expected
    assert engine.get_data_types() == (expected if section else torch.float32,) * 2
    assert engine.amp_enabled() is False and engine.fp16_auto_cast() is False
    assert engine.dynamic_loss_scale_args() is None  # no fp16: no dynamic scaler
    assert engine.initial_dynamic_scale() == 2.0**16
    assert engine.postscale_gradients() and engine.gradient_predivide_factor() == 1.0


def test_zero_queries_read_the_section() -> None:
    pytest.importorskip("ds_zero")
    section = {
        "stage": 2,
        "reduce_bucket_size": 1234,
        "allgather_bucket_size": 4322,
        "overlap_comm": True,
        "contiguous_gradients": False,
        "stage3_prefetch_bucket_size": 77,
        "sub_group_size": 99,
    }
    with pytest.warns(UserWarning, match="zero_optimization.contiguous_gradients=False has no effect"):
        engine = make_engine(tiny_net(0), base_config(zero_optimization=section))
    assert engine.zero_reduce_bucket_size() == 1234 and engine.zero_allgather_bucket_size() == 4322
    assert engine.zero_overlap_comm() and not engine.zero_contiguous_gradients()
    assert engine.zero_prefetch_bucket_size() == 77 and engine.zero_sub_group_size() == 99
    assert engine.zero_reduce_scatter() and engine.zero_allgather_partitions()
    assert engine.zero_param_persistence_threshold() == 100_000 and not engine.zero_nvme_offload_optimizer()
    assert engine.zero_partial_offload() == 1.0 and not engine.is_first_weights_partition_group()
    stage0 = make_engine(tiny_net(0), base_config())
    assert stage0.zero_reduce_bucket_size() == 500_000_000  # DeepSpeed's default without a section


def test_offload_states_needs_an_optimizer() -> None:
    cfg = base_config()
    del cfg["optimizer"]
    engine = make_engine(tiny_net(0), cfg)
    with pytest.raises(RuntimeError, match=r"offload_states\(\) needs an optimizer"):
        engine.offload_states()


def _losses(compiled: bool) -> list[float]:
    engine = make_engine(tiny_net(0), base_config(gradient_accumulation_steps=2))
    if compiled:
        engine.compile(backend="aot_eager")
        assert engine.is_compiled
        engine.compile(backend="inductor")  # a second call is a no-op, as in DeepSpeed
    else:
        assert not engine.is_compiled
    out = []
    for x, y in batches(6, 4):
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()
        out.append(loss.item())
    return out


def test_compile_trains_as_eager() -> None:
    torch._dynamo.reset()
    assert _losses(True) == pytest.approx(_losses(False), rel=1e-5, abs=1e-6)


def test_compile_refuses_deepcompile_arguments() -> None:
    engine = make_engine(tiny_net(0), base_config())
    # pass schedules are honoured with compile.deepcompile (test_deepcompile_schedule.py), compiled autograd
    # too (test_compiled_autograd.py)
    with pytest.raises(TypeError, match="compile_kwargs"):
        engine.compile(compile_kwargs="max-autotune")  # type: ignore[arg-type]
    assert not engine.is_compiled
    assert isinstance(engine, ds_engine.DeepSpeedEngine)


@pytest.mark.parametrize("zipfile", [True, False])
def test_checkpoint_engine_saves_in_the_configured_format(tmp_path: Path, zipfile: bool) -> None:
    from ds_engine.runtime.checkpoint_engine import CheckpointCommitInfo, TorchCheckpointEngine

    engine = make_engine(tiny_net(0), base_config(checkpoint={"checkpoint_serialization": zipfile}))
    ckpt = engine.checkpoint_engine
    assert isinstance(ckpt, TorchCheckpointEngine) and ckpt is engine.checkpoint_engine
    info = CheckpointCommitInfo(tag="t1", save_dir=str(tmp_path), save_latest=True)
    ckpt.create(info)
    ckpt.makedirs(tmp_path / "t1", exist_ok=True)
    state = {"w": torch.arange(4.0), "step": 3}
    ckpt.save(state, tmp_path / "t1" / "x.pt")
    assert ckpt.commit(info) is True
    assert zipfile_module.is_zipfile(tmp_path / "t1" / "x.pt") is zipfile
    loaded = ckpt.load(tmp_path / "t1" / "x.pt", map_location="cpu")
    assert torch.equal(loaded["w"], state["w"]) and loaded["step"] == 3
    assert sorted(p.name for p in (tmp_path / "t1").iterdir()) == ["x.pt"]  # no temporary left behind


def test_offload_config_path() -> None:
    pytest.importorskip("ds_zero")
    import ds_ops
    from ds_engine.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum

    assert OffloadDeviceEnum is ds_ops.OffloadDeviceEnum and OffloadStateTypeEnum.lp_grads == "lp_grads"


def test_small_getters_and_helpers() -> None:
    engine = make_engine(tiny_net(0), base_config())
    assert engine.optimizer_legacy_fusion() is False and engine.torch_autocast_dtype() is None
    assert isinstance(engine.collect_python_gc(), int)
    tensors = [torch.arange(3.0), torch.ones(2, 2)]
    flat = engine.flatten(tensors)
    assert flat.shape == (7,) and all(
        torch.equal(a, b) for a, b in zip(engine.unflatten(flat, tensors), tensors, strict=True)
    )
    assert ds_engine.DeepSpeedOptimizerCallable is not None and ds_engine.DeepSpeedSchedulerCallable is not None


def test_save_checkpoint_refuses_while_states_are_offloaded(tmp_path: Path) -> None:
    from ds_ops import StatesOffloadedError

    engine = make_engine(tiny_net(0), base_config())
    x, y = batches(1, 4)[0]
    engine.backward(loss_fn(engine(x), y))
    engine.step()
    engine.offload_states(include=["optim_states"])
    with pytest.raises(
        StatesOffloadedError, match=r"engine.save_checkpoint\(\) needs the training states optim_states"
    ):
        engine.save_checkpoint(str(tmp_path))
    engine.reload_states()
    assert engine.save_checkpoint(str(tmp_path)) is True
