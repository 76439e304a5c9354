"""The GPU check's decisions that need no GPU: requirement resolution from carried wheels, the size search.

tools/gpu_check.py runs once per GPU lease, so what it decides must be right the first time: which
requirement comes from which carried wheel (and what those wheels need in turn), what it reports
missing; and benchmarks/gpu.py's size search, which must bracket the largest trainable size, skip
sizes the machine cannot hold, and stop at its time cap without mistaking the cap for "too large".
(`nox -s gpu_check_dry_run` runs the whole script end to end.)
"""

from __future__ import annotations

import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
for folder in (ROOT / "tools", ROOT / "benchmarks"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

import _gpu_check_deps as deps  # noqa: E402 - tools/ and benchmarks/ are script folders, not packages
import gpu as bench  # noqa: E402


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "Metadata-Version: 2.1\nName: {}\nVersion: {}\n{}".format(
        name, version, "".join(f"Requires-Dist: {r}\n" for r in requires)
    )
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_requirements_come_from_the_interpreter_then_from_carried_wheels(tmp_path: Path) -> None:
    _wheel(tmp_path, "gpucheck_fake_a", "1.2", ["gpucheck_fake_b>=2", "pytest>=1", "gpucheck_x; extra == 'dev'"])
    _wheel(tmp_path, "gpucheck_fake_b", "2.5", [])
    _wheel(tmp_path, "gpucheck_fake_c", "0.9", [])
    needs = {
        "pytest>=1": ["the CUDA tests"],
        "gpucheck-fake-a>=1": ["ds-x"],
        "gpucheck-fake-c>=1": ["ds-y"],
        "gpucheck-nowhere>=1": ["ds-z"],
    }
    found = deps.resolve(needs, deps.carried_wheels(tmp_path))
    assert "pytest>=1" in found.present
    assert sorted(found.carried) == ["gpucheck-fake-a", "gpucheck-fake-b"]  # b: a's own requirement
    assert len(found.missing) == 2
    assert any("gpucheck-fake-c>=1 (for ds-y)" in m and "not installed" in m for m in found.missing)
    assert any(m.startswith("gpucheck-nowhere>=1 (for ds-z)") for m in found.missing)
    assert "--fetch-wheels" in found.message()


def test_declared_needs_leave_out_siblings_and_add_the_test_tools() -> None:
    needs = deps.declared_needs(ROOT).all()
    names = {deps.Requirement(r).name for r in needs}
    assert {"torch", "pydantic", "hjson", "ninja", "hatchling", "pytest", "pytest-timeout"} <= names
    assert not {n for n in names if n.startswith("ds-")}


class FakeRunner:
    """Stands in for the child processes: sizes up to `fits` layers train, larger ones run out of memory."""

    def __init__(self, plan: Any, fits: int, slow_from: int | None = None) -> None:
        self.plan, self.fits, self.slow_from = plan, fits, slow_from
        self.deadline = float("inf")
        self.probed: list[int] = []

    def run(self, mode: str, layers: int, batch: int, warmup: int, steps: int, cap_s: float) -> dict[str, Any]:
        self.probed.append(layers)
        record = {"mode": mode, "layers": layers, "batch": batch, "params": self.plan.shape.params(layers)}
        if self.slow_from is not None and layers >= self.slow_from:
            return {**record, "status": "timeout", "reason": f"over its {cap_s:.0f} s cap"}
        if layers > self.fits:
            return {**record, "status": "oom", "oom": True}
        return {**record, "status": "ok", "tokens_per_s": 1000.0}


def _plan(host_gib: float = 1e9, disk_gib: float = 1e9) -> Any:
    shape = bench.Shape(dim=1024, heads=8, vocab=1000, seq=128)
    return bench.Plan(shape, [], [], [], "fake", 80.0, host_gib, disk_gib, cpu=False)


@pytest.mark.parametrize("fits", [5, 40, 47, 200])
def test_search_brackets_the_largest_size_within_a_quarter(fits: int) -> None:
    runner = FakeRunner(_plan(), fits)
    found = bench.search(runner, bench.Search("offload", 8, 4, cap_s=1e6, probe_cap_s=60))
    largest, too_large = found["largest"]["layers"], found["too_large_layers"]
    assert largest <= fits < too_large
    assert too_large - largest <= max(1, largest // 4)
    assert found["too_large_because"] == "oom"


def test_search_does_not_try_what_the_host_cannot_hold() -> None:
    plan = _plan(host_gib=16 * bench.Shape(1024, 8, 1000, 128).params(20) / 2**30)  # 20 layers fit the host
    runner = FakeRunner(plan, fits=1000)
    found = bench.search(runner, bench.Search("offload", 8, 4, cap_s=1e6, probe_cap_s=60))
    assert max(runner.probed) <= 20 and found["largest"]["layers"] <= 20
    assert "pinned host memory" in found["too_large_because"]


def test_a_probe_cut_by_the_search_cap_is_not_taken_for_too_large() -> None:
    runner = FakeRunner(_plan(), fits=1000, slow_from=32)
    found = bench.search(runner, bench.Search("infinity", 8, 4, cap_s=50, probe_cap_s=60))
    assert found["largest"]["layers"] == 16 and found["too_large_layers"] is None
    assert found["stopped"].startswith("cap reached during the probe at 32 layers")
