"""The `aio` section (validated by ds_ops.AioConfig) and its hand-over to ds-zero's stage 3 with NVMe offload.

The call site is checked against stand-ins for ds-zero's stage-3 classes (with the `aio_config=`
keyword of the ds-engine/ds-zero NVMe contract), so these tests do not depend on which ds-zero is
installed; tests/dist/test_dist_nvme_engine.py runs the real thing.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest
from ds_engine_testkit import base_config, make_engine, tiny_net

from ds_comm import ConfigDeprecationWarning, ConfigModel
from ds_engine import DeepSpeedConfig
from ds_engine.explain import main as explain_main

AIO = {
    "block_size": 262144,
    "queue_depth": 16,
    "intra_op_parallelism": 2,
    "single_submit": True,
    "overlap_events": False,
}


class _Offload(ConfigModel):
    device: str = "none"
    nvme_path: str | None = None
    pin_memory: bool = False


class _ZeroConfig(ConfigModel):
    stage: int = 0
    reduce_bucket_size: int = 500_000_000
    load_from_fp32_weights: bool = True
    gather_16bit_weights_on_model_save: bool = False
    offload_param: _Offload = _Offload()
    offload_optimizer: _Offload = _Offload()

    # What the engine reads, as ds-zero's `ZeroConfig` names it (sections here are never absent).
    @property
    def offload_param_or_default(self) -> _Offload:
        return self.offload_param

    @property
    def offload_optimizer_or_default(self) -> _Offload:
        return self.offload_optimizer

    @property
    def offload_param_device(self) -> str:
        return self.offload_param.device

    @property
    def offload_optimizer_device(self) -> str:
        return self.offload_optimizer.device if self.stage > 0 else "none"


class _Recorder:
    calls: ClassVar[list[tuple[str, dict[str, Any]]]] = []


class Stage3WithNvme(_Recorder):
    def __init__(
        self,
        optimizer,
        *,
        module=None,
        config=None,
        loss_scaler=None,
        clip_grad=0.0,
        check_overflow=True,
        dp_group=None,
        gradient_predivide_factor=1.0,
        communication_dtype=None,
        aio_config=None,
    ) -> None:
        self.calls.append(("DeepSpeedZeroOptimizer_Stage3", {"aio_config": aio_config, "config": config}))


class OffloadWithNvme(_Recorder):
    def __init__(self, module, *, config=None, dp_group=None, aio_config=None) -> None:
        self.calls.append(("DeepSpeedZeRoOffload", {"aio_config": aio_config, "config": config}))


def _fake_ds_zero() -> types.ModuleType:
    module = types.ModuleType("ds_zero")
    module.__version__ = "0.1.0"
    module.ZeroConfig = _ZeroConfig
    module.DeepSpeedZeroOptimizer_Stage3 = Stage3WithNvme
    module.DeepSpeedZeRoOffload = OffloadWithNvme
    return module


def _nvme_config(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    return base_config(
        aio=dict(AIO),
        zero_optimization={"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(tmp_path)}},
        **overrides,
    )


def test_aio_values_are_validated_and_explained(tmp_path: Path, capsys, caplog) -> None:
    config = DeepSpeedConfig({"train_batch_size": 2, "aio": AIO})
    assert config.aio.queue_depth == 16 and config.aio.single_submit is True
    assert "aio: the section has no effect without NVMe offload" in caplog.text
    with pytest.warns(ConfigDeprecationWarning, match="'thread_count' is deprecated; use 'intra_op_parallelism'"):
        assert DeepSpeedConfig({"train_batch_size": 2, "aio": {"thread_count": 4}}).aio.intra_op_parallelism == 4
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"train_batch_size": 2, "aio": {"queue_depth": 16, "thread_count": 2}}))
    with pytest.warns(ConfigDeprecationWarning):
        assert explain_main([str(path), "--device", "cpu"]) == 0
    rows = {
        line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines() if line.startswith("  aio.")
    }
    assert rows["aio.queue_depth"] == ["16", "set"] and rows["aio.block_size"] == ["1048576", "default"]
    assert rows["aio.intra_op_parallelism"] == ["2", "set"]  # given under its deprecated name
    assert set(rows) == {
        "aio.block_size",
        "aio.queue_depth",
        "aio.intra_op_parallelism",
        "aio.single_submit",
        "aio.overlap_events",
        "aio.use_gds",
    }


def test_nvme_offload_hands_the_aio_section_to_stage_3(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "ds_zero", _fake_ds_zero())
    _Recorder.calls.clear()
    make_engine(tiny_net(0), _nvme_config(tmp_path))
    make_engine(tiny_net(0), _nvme_config(tmp_path, optimizer=None))  # evaluation: DeepSpeedZeRoOffload
    expected = {**AIO, "use_gds": False}
    assert [(name, kw["aio_config"]) for name, kw in _Recorder.calls] == [
        ("DeepSpeedZeroOptimizer_Stage3", expected),
        ("DeepSpeedZeRoOffload", expected),
    ]
    _Recorder.calls.clear()
    make_engine(tiny_net(0), base_config(zero_optimization={"stage": 3, "offload_param": {"device": "cpu"}}))
    assert _Recorder.calls[0][1]["aio_config"] is None  # no NVMe: nothing handed over

    from ds_engine._plan.plan import plan_assembly

    plan = plan_assembly(DeepSpeedConfig(_nvme_config(tmp_path)), device_type="cpu")
    assert (
        f"  NVMe offload (ZeRO-Infinity): parameter partitions under {tmp_path}; aio: block_size=262144, "
        "queue_depth=16, intra_op_parallelism=2, single_submit=True, overlap_events=False"
    ) in plan.lines()
