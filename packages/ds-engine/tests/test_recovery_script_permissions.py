"""`_change_recovery_script_permissions`: chmod +x where allowed; otherwise INFO on "DeepSpeed" and go on."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from ds_engine import DeepSpeedEngine
from ds_engine._checkpoint.recovery_script import change_recovery_script_permissions


def test_sets_owner_execute_bit(tmp_path: Path) -> None:
    script = tmp_path / "zero_to_fp32.py"
    script.write_text("print('hi')\n")
    script.chmod(0o644)
    assert change_recovery_script_permissions(script) is True
    mode = script.stat().st_mode
    assert mode & stat.S_IXUSR
    assert stat.S_IMODE(mode) == 0o744  # only the owner's execute bit is added


def test_missing_file_is_logged_on_deepspeed_logger_and_not_raised(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    missing = tmp_path / "nowhere" / "zero_to_fp32.py"
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        assert change_recovery_script_permissions(missing) is False
    (record,) = [r for r in caplog.records if r.name == "DeepSpeed"]
    assert record.levelno == logging.INFO
    assert str(missing) in record.getMessage()
    assert "python zero_to_fp32.py" in record.getMessage()


def test_refused_chmod_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch) -> None:
    script = tmp_path / "zero_to_fp32.py"
    script.write_text("")

    def refuse(path: object, mode: int) -> None:
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "chmod", refuse)
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        assert change_recovery_script_permissions(script) is False
    assert any("Operation not permitted" in r.getMessage() for r in caplog.records if r.name == "DeepSpeed")


def test_engine_method_is_deepspeeds_private_name(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # The method uses no engine state, so it can be checked without building an engine.
    with caplog.at_level(logging.INFO, logger="DeepSpeed"):
        DeepSpeedEngine._change_recovery_script_permissions(None, tmp_path / "absent.py")  # type: ignore[arg-type]
    assert any("absent.py" in r.getMessage() for r in caplog.records if r.name == "DeepSpeed")
