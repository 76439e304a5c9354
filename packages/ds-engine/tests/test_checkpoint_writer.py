"""`checkpoint.writer` (FastPersist): checkpoints written through `ds_ops.fast_io`, still published atomically.

A save through the FAST writer (single or double buffer, ZeRO 0 and 1) holds what a plain `torch.save` save holds
and loads into a fresh engine to the same weights, optimizer state and counters; a writer that fails mid-save
leaves `latest` and the previous tag as they were, with no temporary file behind; bad values name their key path;
`explain` says which writer saves the files.
"""

from __future__ import annotations

import errno
import importlib.util
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, batches, flat_params, loss_fn, make_engine, tiny_net

from ds_engine import DeepSpeedConfig, DeepSpeedConfigError
from ds_engine._plan.plan import plan_assembly
from ds_engine.explain import explain
from ds_ops.aio import AsyncIOHandle

HAS_ZERO = importlib.util.find_spec("ds_zero") is not None


def _trained(config: dict[str, Any], steps: int = 2):
    model = tiny_net(0)
    engine = make_engine(model, config)
    for x, y in batches(steps, 4):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return engine, model


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "shape") and hasattr(a, "dtype"):  # numpy arrays of the RNG states
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    if type(a) is type(b) and hasattr(a, "__dict__") and not isinstance(a, type):
        return _same(vars(a), vars(b))  # DeepSpeed's layout pickles its loss scaler and fragment addresses
    return bool(a == b)


def _files(root: Path) -> dict[str, Any]:
    out = {}
    for path in sorted((root / "t").iterdir()):
        state = torch.load(path, weights_only=False)
        state.pop("ds_config", None)  # the only difference: the writer section itself
        out[path.name] = state
    return out


_ZERO = pytest.mark.skipif(not HAS_ZERO, reason="ds-zero is not installed")
FAST_SINGLE = {"type": "fast", "io_buffer_size": 8192, "io_buffer_double": False}
FAST_DOUBLE = {"type": "FAST", "io_buffer_size": 16384}


@pytest.mark.parametrize(
    ("writer", "stage"),
    [
        pytest.param(FAST_SINGLE, 0, id="fast-single-zero0"),
        pytest.param(FAST_DOUBLE, 0, id="fast-double-zero0"),
        pytest.param(FAST_DOUBLE, 1, id="fast-double-zero1", marks=_ZERO),  # + the ZeRO partition file
        pytest.param({"type": "python"}, 0, id="python-zero0"),
    ],
)
def test_fast_writer_save_equals_torch_save_and_loads(tmp_path: Path, writer: dict[str, Any], stage: int) -> None:
    config = base_config(zero_optimization={"stage": stage})
    engine, model = _trained(config)
    engine.save_checkpoint(str(tmp_path / "plain"), tag="t")
    fast_config = {**config, "checkpoint": {"writer": writer}}
    fast_engine, fast_model = _trained(fast_config)
    fast_engine.save_checkpoint(str(tmp_path / "fast"), tag="t", client_state={"k": 3})
    engine.save_checkpoint(str(tmp_path / "plain"), tag="t", client_state={"k": 3})
    assert _same(_files(tmp_path / "fast"), _files(tmp_path / "plain"))
    assert not [p for p in (tmp_path / "fast" / "t").iterdir() if p.name.endswith(".tmp")]

    fresh_model = tiny_net(7)
    fresh = make_engine(fresh_model, fast_config)
    _, client = fresh.load_checkpoint(str(tmp_path / "fast"))
    assert client["k"] == 3 and fresh.global_steps == 2
    assert torch.equal(flat_params(fresh_model), flat_params(fast_model))
    for x, y in batches(1, 4, seed=11):  # the restored optimizer continues as the saved one would
        for e in (fresh, fast_engine):
            e.backward(loss_fn(e(x), y))
            e.step()
    assert torch.equal(flat_params(fresh_model), flat_params(fast_model))


def test_a_writer_failing_mid_save_leaves_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = base_config(checkpoint={"writer": {"io_buffer_size": 8192}})
    engine, model = _trained(config)
    engine.save_checkpoint(str(tmp_path), tag="good")
    good = (tmp_path / "good" / "mp_rank_00_model_states.pt").read_bytes()
    real = AsyncIOHandle.async_pwrite
    calls = {"n": 0}

    def failing(self: AsyncIOHandle, tensor: torch.Tensor, path: Any, file_offset: int = 0, **kw: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the device fills up after the first buffer reached it
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(self, tensor, path, file_offset, **kw)

    monkeypatch.setattr(AsyncIOHandle, "async_pwrite", failing)
    for x, y in batches(1, 4, seed=3):
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    with pytest.raises(OSError, match="No space left") as caught:
        engine.save_checkpoint(str(tmp_path), tag="good")  # the same tag: the good file must survive
    assert caught.value.errno == errno.ENOSPC
    assert calls["n"] == 2
    assert (tmp_path / "latest").read_text() == "good"
    assert (tmp_path / "good" / "mp_rank_00_model_states.pt").read_bytes() == good
    assert sorted(p.name for p in (tmp_path / "good").iterdir()) == ["mp_rank_00_model_states.pt"]
    monkeypatch.setattr(AsyncIOHandle, "async_pwrite", real)
    fresh_model = tiny_net(9)
    make_engine(fresh_model, config).load_checkpoint(str(tmp_path))
    before = torch.load(tmp_path / "good" / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert all(torch.equal(before[k], v) for k, v in fresh_model.state_dict().items())


def test_show_statistics_logs_each_file(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine, _ = _trained(base_config(checkpoint={"writer": {"show_statistics": True, "io_buffer_size": 8192}}))
    with caplog.at_level(logging.INFO, logger="ds_engine._checkpoint.file_writer"):
        engine.save_checkpoint(str(tmp_path), tag="s")
    size = (tmp_path / "s" / "mp_rank_00_model_states.pt").stat().st_size
    stats = [r for r in caplog.records if "checkpoint writer statistics" in r.getMessage()]
    assert len(stats) == 1 and f"'aio_bytes': {size}" in stats[0].getMessage()


@pytest.mark.parametrize(
    ("writer", "message"),
    [
        ({"type": "mock"}, r"checkpoint.writer.type: 'MOCK' writes no bytes"),
        ({"type": "nvme"}, r"checkpoint.writer.type"),
        ({"data_parallel": "machine"}, r"checkpoint.writer.data_parallel: 'MACHINE' .* not implemented"),
        ({"io_buffer_size": 1000}, r"checkpoint.writer.io_buffer_size: 1000 must be a multiple of 8192"),
        (
            {"decoupled": True, "data_parallel": "replica"},
            r"checkpoint.writer: decoupled=true with data_parallel='REPLICA' is not implemented",
        ),
        ({"io_multiplier": 2}, r"checkpoint.writer.io_multiplier"),
        ({"type": "python", "data_parallel": "replica"}, r"checkpoint.writer: data_parallel='REPLICA' needs type"),
        ({"buffer_size": 8192}, r"checkpoint.writer.buffer_size: unknown key .*io_buffer_size"),
    ],
)
def test_bad_writer_values_name_the_key(writer: dict[str, Any], message: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=message):
        DeepSpeedConfig({"train_batch_size": 4, "checkpoint": {"writer": writer}}, world_size=1)


def test_checkpoint_engine_is_the_fast_one(tmp_path: Path) -> None:
    from ds_engine.runtime.checkpoint_engine import CheckpointEngine, FastCheckpointEngine, TorchCheckpointEngine

    fast, _ = _trained(base_config(checkpoint={"writer": {"io_buffer_size": 8192}}), steps=0)
    plain, _ = _trained(base_config(), steps=0)
    assert isinstance(fast.checkpoint_engine, FastCheckpointEngine) and fast.checkpoint_writer_enabled()
    assert type(plain.checkpoint_engine) is TorchCheckpointEngine and not plain.checkpoint_writer_enabled()
    assert isinstance(plain.checkpoint_engine, CheckpointEngine) and isinstance(
        fast.checkpoint_engine, CheckpointEngine
    )
    state = {"w": torch.arange(10_000)}
    fast.checkpoint_engine.save(state, str(tmp_path / "x.pt"))  # a script's own file, through the writer
    assert torch.equal(fast.checkpoint_engine.load(str(tmp_path / "x.pt"))["w"], state["w"])
    assert fast.checkpoint_engine.is_data_parallel_writer(0) and not fast.checkpoint_engine.is_decoupled()


def test_explain_shows_the_writer() -> None:
    def line(checkpoint: dict[str, Any], world: int = 1, stage: int = 0) -> str:
        cfg = {"train_batch_size": 4 * world, "checkpoint": checkpoint, "zero_optimization": {"stage": stage}}
        out = explain(DeepSpeedConfig(cfg, world_size=world))
        return next(x for x in out.splitlines() if "checkpoint files:" in x)

    assert "torch.save to a temporary file" in line({})
    fast = line({"writer": {"io_buffer_size": 8192, "data_parallel": "replica"}}, world=2)
    assert "FastPersist writer" in fast and "8192-byte buffer (two halves)" in fast
    assert "every data-parallel rank writes stripes" in fast and "published atomically" in fast
    if HAS_ZERO:
        assert "off at ZeRO stage 3" in line({"writer": {"data_parallel": "replica"}}, world=2, stage=3)
    assert "Python file" in line({"writer": {"type": "python"}})
    piped = plan_assembly(
        DeepSpeedConfig({"train_batch_size": 8, "checkpoint": {"writer": {"data_parallel": "replica"}}}, world_size=2),
        device_type="cpu",
        pipeline=True,
    )
    assert "off in the pipeline engine" in piped.checkpoint_writer
