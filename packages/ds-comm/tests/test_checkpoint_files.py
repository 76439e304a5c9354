"""`ds_comm.load_checkpoint_file`: restricted unpickling with DeepSpeed's classes mapped, clear errors."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import ds_comm
from ds_comm.checkpoint_files import DeepSpeedLossScaler


class _Evil:
    def __reduce__(self):
        return (Path.touch, (Path("/tmp/ds_comm_checkpoint_read_pwned"),))


def _deepspeed_like_pickle(path: Path) -> None:
    """A torch file naming DeepSpeed's class paths, as DeepSpeed writes them, made without DeepSpeed."""

    class Scaler:
        pass

    Scaler.__module__, Scaler.__qualname__ = "deepspeed.runtime.fp16.loss_scaler", "LossScaler"
    scaler = Scaler()
    scaler.cur_scale, scaler.dynamic = 4.0, False

    # pickle imports the class's module by name, and Python imports a dotted name's top package too:
    # placeholders for the leaf and each parent that is not imported (none is, where DeepSpeed is absent).
    parts = "deepspeed.runtime.fp16.loss_scaler".split(".")
    added = [p for p in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if p not in sys.modules]
    for name in added:
        sys.modules[name] = types.ModuleType(name)
    sys.modules["deepspeed.runtime.fp16.loss_scaler"].LossScaler = Scaler  # type: ignore[attr-defined]
    try:
        torch.save({"loss_scaler": scaler, "t": torch.arange(3)}, path)
    finally:
        for name in reversed(added):
            del sys.modules[name]


def test_plain_tensors_round_trip(tmp_path):
    torch.save({"a": torch.ones(2), "b": [1, "x"]}, tmp_path / "f.pt")
    out = ds_comm.load_checkpoint_file(tmp_path / "f.pt")
    assert torch.equal(out["a"], torch.ones(2)) and out["b"] == [1, "x"]


def test_deepspeed_classes_map_onto_stand_ins(tmp_path):
    _deepspeed_like_pickle(tmp_path / "ds.pt")
    out = ds_comm.load_checkpoint_file(tmp_path / "ds.pt")
    assert isinstance(out["loss_scaler"], DeepSpeedLossScaler)
    assert out["loss_scaler"].state_dict() == {"cur_scale": 4.0, "dynamic": False}


def test_arbitrary_pickled_code_is_refused_not_run(tmp_path):
    marker = Path("/tmp/ds_comm_checkpoint_read_pwned")
    marker.unlink(missing_ok=True)
    torch.save({"x": _Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ds_comm.CheckpointFileError, match=r"evil\.pt.*allow-list"):
        ds_comm.load_checkpoint_file(tmp_path / "evil.pt")
    assert not marker.exists()


@pytest.mark.parametrize("keep", [0, 100, 0.5, 0.95])
def test_truncated_file_names_the_file(tmp_path, keep):
    torch.save({"a": torch.randn(1000)}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    cut = keep if isinstance(keep, int) else int(len(data) * keep)
    (tmp_path / "cut.pt").write_bytes(data[:cut])
    with pytest.raises(ds_comm.CheckpointFileError, match=r"cut\.pt.*(empty|truncated|corrupt|damaged)"):
        ds_comm.load_checkpoint_file(tmp_path / "cut.pt")


def test_flipped_tensor_bytes_fail_the_crc(tmp_path):
    torch.save({"a": torch.zeros(4096)}, tmp_path / "f.pt")
    data = bytearray((tmp_path / "f.pt").read_bytes())
    at = data.find(bytes(64), len(data) // 3)
    data[at + 10] ^= 0xFF
    (tmp_path / "f.pt").write_bytes(bytes(data))
    with pytest.raises(ds_comm.CheckpointFileError, match=r"f\.pt.*(CRC|corrupt)"):
        ds_comm.load_checkpoint_file(tmp_path / "f.pt")


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.pt"):
        ds_comm.load_checkpoint_file(tmp_path / "nope.pt")


def test_newer_deepspeed_version_says_so(tmp_path):
    ds_comm.check_deepspeed_version("0.19.8", tmp_path / "a.pt")
    ds_comm.check_deepspeed_version("0.14.0+abc", tmp_path / "a.pt")
    with pytest.raises(ds_comm.CheckpointFileError, match=r"a\.pt.*DeepSpeed 0\.20\.1.*newer.*0\.19\.8"):
        ds_comm.check_deepspeed_version("0.20.1", tmp_path / "a.pt")


def test_stand_ins_write_under_deepspeed_names_and_read_back(tmp_path):
    from ds_comm.checkpoint_files import DeepSpeedFragmentAddress, DeepSpeedZeroStage, deepspeed_pickle_names

    scaler = DeepSpeedLossScaler()
    scaler.__setstate__({"cur_scale": 2.0, "dynamic": False})
    address = DeepSpeedFragmentAddress()
    address.__setstate__({"numel": 3, "start": 5})
    before = set(sys.modules)
    with deepspeed_pickle_names():
        torch.save({"s": scaler, "z": DeepSpeedZeroStage.gradients, "a": address}, tmp_path / "f.pt")
    assert set(sys.modules) == before and DeepSpeedLossScaler.__module__ == "ds_comm.checkpoint_files"
    names = set(torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "f.pt"))
    assert names == {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
    out = ds_comm.load_checkpoint_file(tmp_path / "f.pt")
    assert out["s"].cur_scale == 2.0 and out["z"] == 2 and (out["a"].numel, out["a"].start) == (3, 5)


def test_an_imported_deepspeed_module_is_shadowed_while_saving_and_restored(tmp_path, monkeypatch):
    """With `deepspeed.runtime.zero.config` really imported (ds's alias does that), saving still writes
    DeepSpeed's name, and the module keeps its own class afterwards."""
    from ds_comm.checkpoint_files import DeepSpeedZeroStage, deepspeed_pickle_names

    class ZeroStageEnum(int):
        pass

    for name in ("deepspeed", "deepspeed.runtime", "deepspeed.runtime.zero"):
        monkeypatch.setitem(sys.modules, name, sys.modules.get(name) or types.ModuleType(name))
    imported = types.ModuleType("deepspeed.runtime.zero.config")
    imported.ZeroStageEnum = ZeroStageEnum
    monkeypatch.setitem(sys.modules, "deepspeed.runtime.zero.config", imported)
    with deepspeed_pickle_names():
        assert imported.ZeroStageEnum is DeepSpeedZeroStage
        torch.save({"z": DeepSpeedZeroStage.optimizer_states}, tmp_path / "f.pt")
    assert imported.ZeroStageEnum is ZeroStageEnum
    names = set(torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "f.pt"))
    assert names == {"deepspeed.runtime.zero.config.ZeroStageEnum"}
    assert ds_comm.load_checkpoint_file(tmp_path / "f.pt")["z"] == 1
