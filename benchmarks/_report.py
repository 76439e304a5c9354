"""The benchmarks' common machine-readable output: one row per figure, written as a JSON list by `--json PATH`.

Every benchmark keeps its own human-readable table on stdout; with `--json PATH` it also writes its
figures as `Row`s, which `benchmarks/results.py` gathers into `benchmarks/RESULTS.md`.

[Note: ratio and target] `ratio` is `value / baseline_value` (so for times, below 1 means
faster than the baseline) unless a benchmark passes its own: a *paired* figure (named so) gives the
median of per-round ratios, which cancels host drift that a ratio of two medians keeps.
`target` is text: a comparison and a number, e.g. `"<= 1.02"`, `">= 0.9"`,
`"< 0.3 s"`, `"== 0"`. A target that carries a unit after the number bounds the value (in the row's
unit); a bare number bounds the ratio, or the value when the row has no ratio. `met` is that
comparison's outcome, None when there is no target or nothing to compare.
"""

from __future__ import annotations

import argparse
import json
import math
import operator
import re
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KEYS = ("benchmark", "figure", "value", "unit", "baseline", "baseline_value", "ratio", "target", "met")

_COMPARE: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
    "==": operator.eq,
}
_TARGET = re.compile(r"^\s*(<=|>=|==|<|>)\s*([-+0-9.eE]+)\s*(\S.*)?$")


@dataclass(frozen=True)
class Row:
    """One figure of one benchmark next to its baseline.

    Attributes:
        benchmark: the benchmark's name (its file name without `.py`).
        figure: what was measured, with its setting ("all_reduce 16 MiB latency, ds/raw").
        value: our measurement, in `unit`.
        unit: the unit of `value` and `baseline_value` ("ms", "s", "MiB", "" for a pure number).
        baseline: what we compare with ("torch.distributed", "torch DDP", "DeepSpeed 0.19.8").
        baseline_value: the baseline's measurement in the same unit; None when there is none.
        ratio: `value / baseline_value`; filled in when omitted and both exist.
        target: the goal as text (see the module note), "" for none.
        met: whether the target holds; computed from `target` when omitted.
    """

    benchmark: str
    figure: str
    value: float | None
    unit: str = ""
    baseline: str = ""
    baseline_value: float | None = None
    ratio: float | None = None
    target: str = ""
    met: bool | None = field(default=None)

    def __post_init__(self) -> None:
        if self.ratio is None and self.value is not None and self.baseline_value:
            object.__setattr__(self, "ratio", self.value / self.baseline_value)
        if self.met is None:
            object.__setattr__(self, "met", target_met(self.target, self.value, self.ratio))


def target_met(target: str, value: float | None, ratio: float | None) -> bool | None:
    """Whether `target` holds for this value/ratio (see the module note); None if it cannot be decided."""
    match = _TARGET.match(target or "")
    if not match:
        return None
    compare, bound, unit = _COMPARE[match.group(1)], float(match.group(2)), match.group(3)
    subject = value if unit or ratio is None else ratio
    if subject is None or (isinstance(subject, float) and math.isnan(subject)):
        return None
    return bool(compare(subject, bound))


def row_from_dict(data: Mapping[str, Any], benchmark: str) -> Row:
    """A Row from a JSON object; `benchmark` fills a missing "benchmark" key, `met` is computed when missing.

    Raises:
        ValueError: the object has no "figure", or an unknown key.
    """
    unknown = set(data) - set(KEYS)
    if unknown:
        raise ValueError(f"benchmark row {dict(data)!r} has unknown keys {sorted(unknown)}; allowed: {list(KEYS)}")
    if "figure" not in data:
        raise ValueError(f"benchmark row {dict(data)!r} has no 'figure'")
    fields = {k: data[k] for k in KEYS if k in data and data[k] is not None}
    fields.setdefault("benchmark", benchmark)
    fields.setdefault("value", None)
    return Row(**fields)


def read_rows(path: Path) -> list[Row]:
    """The rows of one `--json` file; a missing "benchmark" is the file's stem (`aio.json` -> "aio")."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of rows, got {type(data).__name__}")
    return [row_from_dict(item, Path(path).stem) for item in data]


def paired_ratio(values: Sequence[float], baselines: Sequence[float]) -> float:
    """The ratio of a *paired* figure (see [Note: ratio and target]): the median over rounds of each round's
    value over the same round's baseline."""
    return statistics.median(v / b for v, b in zip(values, baselines, strict=True))


def _finite(x: Any) -> Any:
    return None if isinstance(x, float) and not math.isfinite(x) else x


def write_rows(path: str | Path | None, rows: Iterable[Row]) -> None:
    """Write rows as a JSON list to `path` (nothing when `path` is empty); NaN/inf become null."""
    if not path:
        return
    items = [{k: _finite(v) for k, v in asdict(row).items()} for row in rows]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(items, indent=1) + "\n")


def add_json_argument(parser: argparse.ArgumentParser) -> None:
    """The `--json PATH` option every benchmark takes."""
    parser.add_argument(
        "--json",
        default="",
        metavar="PATH",
        help="also write the figures as a JSON list of rows (see benchmarks/_report.py)",
    )
