"""COMPATIBILITY.md tells the truth about DeepSpeed's module paths: its generated section matches a fresh probe."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(600)
def test_module_paths_section_matches_what_imports_under_ds() -> None:
    pytest.importorskip("deepspeed._aliases", reason="needs ds's deepspeed distribution")
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compat_modules.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_the_missing_path_error_points_to_the_page() -> None:
    aliases = pytest.importorskip("deepspeed._aliases", reason="needs ds's deepspeed distribution")
    assert aliases.COMPATIBILITY_PAGE.startswith("COMPATIBILITY.md")
    assert (ROOT / "COMPATIBILITY.md").is_file()
