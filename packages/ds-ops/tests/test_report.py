"""ds_report / python -m ds_ops.report: environment lines and one row per op with its status and reasons."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from _toy_ops import subprocess_env

from ds_comm import get_accelerator
from ds_ops import ALL_OPS, CPULionBuilder
from ds_ops.report import main, render


def test_report_lists_environment_and_every_op(capsys: pytest.CaptureFixture[str]) -> None:
    CPULionBuilder().load()  # in the session cache: the report shows it as cached
    assert main([]) == 0
    text = capsys.readouterr().out
    for label in (
        "torch version",
        "torch CUDA version",
        "accelerator",
        "ninja",
        "C++ compiler",
        "nvcc",
        "SIMD level",
        "JIT cache",
    ):
        assert label in text, label
    assert torch.__version__ in text
    rows = {
        line.split()[0]: line.split()[1:]
        for line in text.splitlines()
        if line.split()[:1] and line.split()[0] in ALL_OPS
    }
    assert set(rows) == set(ALL_OPS)
    assert rows["cpu_lion"] == ["[NO]", "[YES]", "[OKAY]"]  # not prebuilt, cached, compatible
    if get_accelerator().device_name() == "cpu":  # the CPU accelerator's fused_adam: the CPU Adam kernel
        assert rows["fused_adam"][::2] == ["[NO]", "[OKAY]"]  # never prebuilt; compatible
        assert "fused_adam: CUDA is not available" not in text


def test_hide_flags() -> None:
    assert "op name" not in render(show_ops=False)
    assert "why not compatible" not in render(show_errors=False)


def test_module_and_console_script_run() -> None:
    commands = [[sys.executable, "-m", "ds_ops.report", "--hide_operator_status"]]
    if shutil.which("ds_report"):
        commands.append(["ds_report", "--hide_operator_status"])
    for command in commands:
        result = subprocess.run(command, env=subprocess_env(), capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        assert "ds-ops report" in result.stdout and "SIMD level" in result.stdout
