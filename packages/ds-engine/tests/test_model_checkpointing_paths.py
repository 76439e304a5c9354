"""DeepSpeed's `runtime.model_checkpointing.{config,writer_factory,data_parallel_writer_factory,utils}` and
`runtime.checkpoint_engine.utils` over ds's objects.

The section comes back as DeepSpeed's dicts, validated (a bad value names its key path); the writer factory's
FAST file is what `torch.save` writes to a file object, PYTHON's too, MOCK's holds nothing; the data-parallel
writer decision equals DeepSpeed 0.19.8's on the same layouts (the table below was produced by DeepSpeed's
`DataParallelWriterFactory`: 4 ranks; a tp=2 x dp=2 mpu on rank 3; an expert layout ep=2 x edp=2 on rank 3);
`create_checkpoint_engine` picks the engine the config asks for.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch

from ds_comm import ConfigError
from ds_engine import DeepSpeedConfig
from ds_engine.runtime.checkpoint_engine import (
    DecoupledCheckpointEngine,
    FastCheckpointEngine,
    TorchCheckpointEngine,
    create_checkpoint_engine,
)
from ds_engine.runtime.model_checkpointing import CheckpointWriterFactory
from ds_engine.runtime.model_checkpointing.config import get_checkpoint_config, get_checkpoint_writer_config
from ds_engine.runtime.model_checkpointing.data_parallel_writer_factory import DataParallelWriterFactory
from ds_engine.runtime.model_checkpointing.utils import (
    ExpertParallelInfo,
    MPUInfo,
    UniversalParallelInfo,
    create_data_parallel_writer_config,
)

# DeepSpeed 0.19.8's answers: (world_size, rank) of the writer config, None for no config.
_DS_PURE = {
    None: {0: [(1, 0), None, None, None], 1: [(1, 0)] * 4, 2: [(1, 0)] * 4, 3: [(1, 0)] * 4},
    "REPLICA": {s: [(4, r) for r in range(4)] for s in (0, 1, 2)} | {3: [(1, 0)] * 4},
}
_DS_MPU = {None: {0: None, 3: (1, 0)}, "REPLICA": {0: (2, 1), 3: (1, 0)}}
_DS_MOE = {None: {0: None, 1: (1, 0)}, "REPLICA": {0: (2, 1), 1: (2, 1)}}


def _info(rank: int, mpu: MPUInfo | None = None, ep: ExpertParallelInfo | None = None) -> UniversalParallelInfo:
    return UniversalParallelInfo(
        global_world_size=4,
        global_rank=rank,
        local_rank=rank,
        mpu_info=mpu,
        ep_info=ep,
        pure_dp=mpu is None or mpu.dp_world_size == 4,
        num_machines=1,
        machine_rank=0,
        num_sockets=2,
        dp_rank=rank,
    )


def _pair(config: Any) -> tuple[int, int] | None:
    return None if config is None else (config.world_size, config.rank)


@pytest.mark.parametrize("unit", [None, "REPLICA"])
def test_writer_decision_equals_deepspeeds(unit: str | None) -> None:
    for stage, expected in _DS_PURE[unit].items():
        assert [_pair(DataParallelWriterFactory(_info(r), unit).create_config(stage, False)) for r in range(4)] == (
            expected
        ), stage
    mpu = MPUInfo(
        pp_world_size=1, pp_rank=0, tp_world_size=2, tp_rank=1, dp_world_size=2, dp_peer_ranks=[1, 3], dp_rank=1
    )
    for stage, expected in _DS_MPU[unit].items():
        assert _pair(DataParallelWriterFactory(_info(3, mpu=mpu), unit).create_config(stage, False)) == expected
    ep = ExpertParallelInfo(ep_world_size=2, ep_rank=1, dp_world_size=2, dp_peer_ranks=[1, 3], dp_rank=1)
    for stage, expected in _DS_MOE[unit].items():
        assert _pair(DataParallelWriterFactory(_info(3, ep=ep), unit).create_config(stage, True)) == expected


def test_socket_and_machine_units_are_refused() -> None:
    for unit in ("socket", "MACHINE"):
        with pytest.raises(ValueError, match=r"checkpoint.writer.data_parallel: '(SOCKET|MACHINE)' is not implemented"):
            DataParallelWriterFactory(_info(0), unit)


def test_config_dicts_are_deepspeeds_and_validated() -> None:
    assert get_checkpoint_config({}) == {"tag_validation": "WARN", "checkpoint_serialization": True, "writer": None}
    cfg = get_checkpoint_config({"checkpoint": {"tag_validation": "fail", "writer": {"type": "python"}}})
    assert cfg["tag_validation"] == "FAIL" and cfg["writer"] == {
        "type": "PYTHON",
        "io_buffer_size": 64 * 1024**2,
        "io_buffer_double": True,
        "show_statistics": False,
        "data_parallel": None,
        "decoupled": False,
        "io_multiplier": 1,
    }
    assert get_checkpoint_writer_config({"writer": {"type": "mock", "decoupled": True}})["type"] == "MOCK"
    assert get_checkpoint_writer_config({}) is None
    with pytest.raises(ConfigError, match=r"checkpoint.writer.io_buffer_size: .*1000 must be a multiple of 8192"):
        get_checkpoint_writer_config({"writer": {"io_buffer_size": 1000}})


def _writer_config(kind: str) -> dict[str, Any]:
    return get_checkpoint_writer_config({"writer": {"type": kind, "io_buffer_size": 8192, "show_statistics": True}})


@pytest.mark.parametrize("kind", ["fast", "python", "mock"])
def test_writer_factory_writes_what_torch_save_writes(tmp_path: Path, kind: str) -> None:
    factory = CheckpointWriterFactory(_writer_config(kind), {"block_size": 4096, "queue_depth": 4}, None)
    state = {"w": torch.randn(5000), "step": 3}
    writer = factory.create_writer(tmp_path / "a.pt", optimize_dp_state=False)
    with pytest.raises(RuntimeError, match="still out; call release_writer"):
        factory.create_writer(tmp_path / "b.pt", optimize_dp_state=False)
    torch.save(state, writer)
    factory.release_writer()
    with open(tmp_path / "ref.pt", "wb") as f:
        torch.save(state, f)
    reference = (tmp_path / "ref.pt").read_bytes()
    if kind == "mock":
        assert not (tmp_path / "a.pt").exists() or (tmp_path / "a.pt").stat().st_size == 0
    else:
        assert (tmp_path / "a.pt").read_bytes() == reference
    factory.create_writer(tmp_path / "c.pt", optimize_dp_state=False)  # released: the next one may be made
    factory.release_writer()


def test_create_checkpoint_engine_picks_the_configured_one(tmp_path: Path) -> None:
    groups = types.SimpleNamespace(mpu=None)

    def engine(checkpoint: dict[str, Any] | None) -> Any:
        raw: dict[str, Any] = {"train_batch_size": 4}
        if checkpoint is not None:
            raw["checkpoint"] = checkpoint
        return create_checkpoint_engine(DeepSpeedConfig(raw, world_size=1), groups, 0, False, False)

    assert type(engine(None)) is TorchCheckpointEngine
    assert type(engine({"writer": {"io_buffer_size": 8192}})) is FastCheckpointEngine
    decoupled = engine({"writer": {"io_buffer_size": 8192, "decoupled": True}})
    assert type(decoupled) is DecoupledCheckpointEngine and decoupled.is_data_parallel_writer(0)
    decoupled.save({"x": torch.ones(3)}, str(tmp_path / "x.pt"))
    from ds_engine.runtime.checkpoint_engine import CheckpointCommitInfo

    assert decoupled.commit(CheckpointCommitInfo("t", str(tmp_path), False))
    assert torch.equal(decoupled.load(str(tmp_path / "x.pt"))["x"], torch.ones(3))
    assert _pair(create_data_parallel_writer_config(groups, None, 0, False)) == (1, 0)


def test_deepspeed_paths_are_ds_objects() -> None:
    import importlib

    pytest.importorskip("deepspeed", reason="the deepspeed distribution maps these paths")

    ds_path = importlib.import_module("deepspeed.runtime.model_checkpointing.writer_factory")
    assert ds_path.CheckpointWriterFactory is CheckpointWriterFactory
    utils = importlib.import_module("deepspeed.runtime.checkpoint_engine.utils")
    assert utils.create_checkpoint_engine is create_checkpoint_engine
