"""`copy_zero_to_fp32_script`: the recovery script lands next to a checkpoint, executable where chmod works."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

import ds_zero
from ds_zero._checkpoint.script_copy import ZERO_TO_FP32_SCRIPT


def test_the_script_is_written_executable_and_an_identical_copy_is_kept(tmp_path: Path) -> None:
    target = ds_zero.copy_zero_to_fp32_script(tmp_path)
    assert target == tmp_path / "zero_to_fp32.py"
    assert target.read_text() == ZERO_TO_FP32_SCRIPT.read_text()
    assert target.stat().st_mode & stat.S_IXUSR
    inode = target.stat().st_ino
    ds_zero.copy_zero_to_fp32_script(tmp_path)
    assert target.stat().st_ino == inode  # not rewritten


def test_a_file_system_refusing_chmod_does_not_fail_the_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(self: Path, mode: int, **kwargs: object) -> None:
        raise PermissionError(1, "Operation not permitted", os.fspath(self))

    monkeypatch.setattr(Path, "chmod", refuse)
    with caplog.at_level(logging.INFO, logger="ds_zero"):
        target = ds_zero.copy_zero_to_fp32_script(tmp_path)
    assert target.read_text() == ZERO_TO_FP32_SCRIPT.read_text()
    assert "could not make" in caplog.text and "zero_to_fp32.py" in caplog.text
