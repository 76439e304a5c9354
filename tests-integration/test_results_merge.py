"""`benchmarks/results.py --only A,B` replaces those benchmarks' parts of RESULTS.md and keeps everyone else's.

Pages are rendered by the real `_results_md.render` from made-up rows, so the merge is checked against the
layout the runner writes, not against a hand-written copy of it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import _results_md  # noqa: E402 - benchmarks/ is a script folder, not a package
from _report import Row  # noqa: E402
from _results_merge import merge_pages  # noqa: E402

ORDER = ["comm", "zero", "loss_curves", "hf_trainer", "ulysses", "aio"]
MACHINE = {"CPU": "test", "commit": "abc"}


def _run(name: str, seconds: float) -> dict:
    return {
        "benchmark": name,
        "args": [],
        "seconds": seconds,
        "status": "ok",
        "load_before": (0.1, 0.1, 0.1),
        "load_after": (0.2, 0.2, 0.2),
        "others_cores": 0.0,
    }


def _page(values: dict[str, float], folder: Path) -> str:
    rows = [Row(name, f"{name} figure {i}", value + i, "ms") for name, value in values.items() for i in range(2)]
    return _results_md.render(
        machine=MACHINE,
        rows=rows,
        runs=[_run(name, value) for name, value in values.items()],
        texts={name: f"{name} printout {value}" for name, value in values.items()},
        quick=False,
        label="",
        loads=((0.1, 0.1, 0.1), (0.2, 0.2, 0.2)),
        total_s=60.0,
        plot=folder / "loss_curves.svg",
        command="python benchmarks/results.py",
    )


def _rows(page: str, heading: str) -> list[str]:
    section = page.split(heading, 1)[1].split("\n## ", 1)[0]
    skip = ("| benchmark", "| ---")
    return [line for line in section.splitlines() if line.startswith("| ") and not line.startswith(skip)]


def test_only_replaces_the_named_benchmarks_and_adds_their_plot_section(tmp_path: Path) -> None:
    (tmp_path / "loss_curves.svg").write_text("<svg/>")
    old = _page({"comm": 1.0, "zero": 2.0, "loss_curves": 3.0, "hf_trainer": 4.0, "aio": 5.0}, tmp_path)
    assert _results_md.ULYSSES_HEADING not in old
    (tmp_path / "ulysses.svg").write_text("<svg/>")
    new = _page({"hf_trainer": 40.0, "ulysses": 50.0}, tmp_path)
    merged = merge_pages(old, new, ["hf_trainer", "ulysses"], ORDER, "hf_trainer, ulysses re-run")

    figures = _rows(merged, "## Figures")
    assert [r.split("|")[1].strip() for r in figures] == ["comm"] * 2 + ["zero"] * 2 + ["hf_trainer"] * 2 + [
        "ulysses"
    ] * 2 + ["aio"] * 2
    assert figures[:4] == _rows(old, "## Figures")[:4] and figures[-2:] == _rows(old, "## Figures")[-2:]
    assert figures[4:8] == _rows(new, "## Figures")
    assert "| 40 ms |" in figures[4] and "| 4 ms |" not in merged.split("## Runs")[0].split("## Loss")[0]
    # The loss-curve rows and plot are loss_curves': untouched.
    assert (
        merged.split("## Loss curves", 1)[1].split("\n## ", 1)[0]
        == old.split("## Loss curves", 1)[1].split("\n## ", 1)[0]
    )
    # The new plot section sits after the other plot sections, before Runs, and embeds the SVG.
    headings = [line for line in merged.splitlines() if line.startswith("## ")]
    assert headings == [
        "## Figures",
        _results_md.LOSS_HEADING,
        _results_md.ULYSSES_HEADING,
        "## Runs",
        "## Raw output",
    ]
    assert "![ulysses](ulysses.svg)" in merged
    runs = _rows(merged, "## Runs")
    assert [r.split("|")[1].strip() for r in runs] == ["comm", "zero", "loss_curves", "hf_trainer", "ulysses", "aio"]
    assert "| 40 s |" in runs[3] and "| 5 s |" in runs[5]
    raw = merged.split("## Raw output", 1)[1]
    assert raw.index("zero printout 2.0") < raw.index("hf_trainer printout 40.0") < raw.index("ulysses printout 50.0")
    assert "hf_trainer printout 4.0" not in raw and raw.index("ulysses printout") < raw.index("aio printout 5.0")
    # The page's header (the full run) stays, with the note under the title.
    assert merged.startswith("# Benchmark results\n\n> hf_trainer, ulysses re-run\n")
    assert old.split("\n## Figures")[0].removeprefix("# Benchmark results\n") in merged


def test_merging_twice_replaces_rather_than_duplicates(tmp_path: Path) -> None:
    (tmp_path / "ulysses.svg").write_text("<svg/>")
    old = _page({"comm": 1.0, "ulysses": 2.0}, tmp_path)
    once = merge_pages(old, _page({"ulysses": 20.0}, tmp_path), ["ulysses"], ORDER, "first")
    twice = merge_pages(once, _page({"ulysses": 200.0}, tmp_path), ["ulysses"], ORDER, "second")
    assert twice.count(_results_md.ULYSSES_HEADING) == 1 and twice.count("<summary>ulysses</summary>") == 1
    assert [r.split("|")[3].strip() for r in _rows(twice, "## Figures")] == ["1 ms", "2 ms", "200 ms", "201 ms"]
    assert twice.startswith("# Benchmark results\n\n> second\n\n> first\n")
