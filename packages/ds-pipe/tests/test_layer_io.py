"""Layer files are written atomically: through a unique temporary name, also when a checkpoint engine writes them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from ds_pipe._layer_io import layer_file_name, load_layers, save_layers


class _RecordingEngine:
    def __init__(self, fail: bool = False) -> None:
        self.saved_to: list[str] = []
        self.fail = fail

    def save(self, state_dict: Any, path: str) -> None:
        self.saved_to.append(path)
        torch.save(state_dict, path)
        if self.fail:
            raise OSError("the engine's storage went away")

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location)


def _layers(seed: int) -> list[tuple[int, nn.Module | None]]:
    torch.manual_seed(seed)
    return [(0, nn.Linear(3, 2)), (1, None), (2, nn.Linear(2, 2))]


def test_a_checkpoint_engine_writes_a_temporary_that_is_renamed(tmp_path: Path) -> None:
    engine = _RecordingEngine()
    written = save_layers(_layers(0), tmp_path, "", engine=engine)
    assert [p.name for p in written] == [layer_file_name(0, ""), layer_file_name(2, "")]
    for tmp, final in zip(engine.saved_to, written, strict=True):
        assert Path(tmp).parent == tmp_path and Path(tmp).name.startswith(f".{final.name}.") and tmp != str(final)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in written)
    loaded = _layers(1)
    load_layers(loaded, tmp_path, "", engine=engine)
    for (_, a), (_, b) in zip(_layers(0), loaded, strict=True):
        if a is not None:
            torch.testing.assert_close(a.state_dict(), b.state_dict())


def test_a_failed_write_keeps_the_previous_layer_file(tmp_path: Path) -> None:
    save_layers(_layers(0), tmp_path, "")
    before = torch.load(tmp_path / layer_file_name(0, ""))
    with pytest.raises(OSError, match="storage went away"):
        save_layers(_layers(5), tmp_path, "", engine=_RecordingEngine(fail=True))
    torch.testing.assert_close(torch.load(tmp_path / layer_file_name(0, "")), before)
    assert sorted(p.name for p in tmp_path.iterdir()) == [layer_file_name(0, ""), layer_file_name(2, "")]
