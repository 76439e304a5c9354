"""What tools/deepspeed_examples.py reads from a run and writes out: losses, the first error, the JSON, the table.

Pure functions over text and dicts (no DeepSpeed, no checkout), so they are tested on their own
(tests-integration/test_deepspeed_examples_tool.py).

The results JSON:

    {"examples_commit": "45b4b715...",
     "programs": {"cifar10-zero2": {"source": "training/cifar", "deterministic": true, "notes": "...",
                                    "sides": {"deepspeed": SIDE, "ds": SIDE}}}}

and SIDE = {"status": "ran" | "failed" | "timeout" | "not prepared", "rc": int | null, "first_error": str,
"losses": [float], "wall_s": float, "command": str, "log": str, "date": str}. A run of one side merges into
the file the other side wrote (`merge`), so the two sides can run at different times or on different hosts.
"""

from __future__ import annotations

import math
import re
from typing import Any

SIDES = ("deepspeed", "ds")
SIDE_TITLES = {"deepspeed": "DeepSpeed 0.19.8", "ds": "ds"}
#: Losses agree when |a - b| <= ATOL + RTOL * |b| for every pair (the same kernels on the same data give equal
#: losses up to reduction order; bf16 programs keep a few ulps of room).
RTOL, ATOL = 2e-3, 1e-5

_RANK_PREFIX = re.compile(r"^(\[(default)?rank\d+\]:|\d+:)\s?", re.IGNORECASE)
_EXCEPTION = re.compile(r"^([A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)|AssertionError|KeyError)\b(:.*)?$")
_ERRORISH = re.compile(r"error|exception|fatal|killed|traceback", re.IGNORECASE)


def parse_losses(output: str, pattern: str) -> list[float]:
    """Every loss `pattern`'s one group captures in `output`, in order (a multiline regex: `^` is a line start)."""
    losses = []
    for match in re.finditer(pattern, output, re.MULTILINE):
        try:
            losses.append(float(match.group(1)))
        except ValueError:
            continue
    return losses


def first_error(output: str) -> str:
    """The line that says what went wrong first: the exception line closing the first traceback.

    Launchers prefix rank output (`[rank0]: `, `0: `), and several ranks print the same traceback; the
    first traceback's exception is the cause, later ones are usually its echo in other ranks. Without a
    traceback, the last line that mentions an error; failing that, the last line.
    """
    lines = [_RANK_PREFIX.sub("", line.rstrip()) for line in output.splitlines()]
    for index, line in enumerate(lines):
        if line.startswith("Traceback (most recent call last):"):
            for offset, later in enumerate(lines[index + 1 :], start=index + 2):
                if later and not later.startswith((" ", "\t")) and _EXCEPTION.match(later):
                    return _with_detail(later, lines[offset : offset + 1])[:300]
    errorish = [line for line in lines if _ERRORISH.search(line)]
    if errorish:
        return errorish[-1].strip()[:300]
    tail = [line for line in lines if line.strip()]
    return tail[-1].strip()[:300] if tail else ""


def _with_detail(line: str, following: list[str]) -> str:
    """An exception line ending in ":" (its message goes on below, as config errors do) plus its next line."""
    if line.endswith(":") and following and following[0].strip() and not following[0].startswith("Traceback"):
        return f"{line} {following[0].strip()}"
    return line


def agreement(reference: list[float], candidate: list[float], deterministic: bool) -> dict[str, Any]:
    """Whether two sides' losses agree: {"agree": True | False | None, "max_diff": float | None, "why": str}.

    `None` when there is nothing to compare (a side has no losses) or the program is not deterministic, in which
    case the difference is still reported for what it shows.
    """
    if not reference or not candidate:
        return {"agree": None, "max_diff": None, "why": "no losses to compare"}
    pairs = list(zip(reference, candidate, strict=False))
    diffs = [_diff(a, b) for a, b in pairs]
    max_diff = max(diffs)
    if not deterministic:
        return {"agree": None, "max_diff": max_diff, "why": "not deterministic"}
    if len(reference) != len(candidate):
        return {"agree": False, "max_diff": max_diff, "why": f"{len(reference)} vs {len(candidate)} losses"}
    for index, ((a, b), diff) in enumerate(zip(pairs, diffs, strict=True)):
        if diff and not diff <= ATOL + RTOL * abs(b):
            return {"agree": False, "max_diff": max_diff, "why": f"first at loss #{index + 1}: {a:.6g} vs {b:.6g}"}
    return {"agree": True, "max_diff": max_diff, "why": ""}


def _diff(a: float, b: float) -> float:
    """|a - b|, 0 for two equal values (two NaNs included), inf when only one is finite."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    return abs(a - b) if math.isfinite(a) and math.isfinite(b) else math.inf


def merge(existing: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """`new` over `existing`: program by program, side by side; a program's fields and a side's result are replaced."""
    merged = {key: value for key, value in existing.items() if key != "programs"}
    merged.update({key: value for key, value in new.items() if key != "programs"})
    programs = {name: dict(entry) for name, entry in existing.get("programs", {}).items()}
    for name, entry in new.get("programs", {}).items():
        old = programs.get(name, {})
        sides = {**old.get("sides", {}), **entry.get("sides", {})}
        programs[name] = {**old, **entry, "sides": sides}
    merged["programs"] = programs
    return merged


def _cell(text: str, limit: int = 160) -> str:
    text = " ".join(text.split()).replace("|", "\\|")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _status(side: dict[str, Any] | None) -> str:
    if side is None:
        return "not run"
    if side["status"] == "ran":
        return "ran"
    return _cell(
        f"**{side['status']}**: `{side.get('first_error', '')}`" if side.get("first_error") else side["status"]
    )


def _losses(side: dict[str, Any] | None) -> str:
    losses = (side or {}).get("losses") or []
    if not losses:
        return "-"
    if len(losses) == 1:
        return f"{losses[0]:.4f}"
    return f"{losses[0]:.4f} → {losses[-1]:.4f} ({len(losses)})"


def _agree(entry: dict[str, Any]) -> str:
    sides = entry.get("sides", {})
    if not all(sides.get(side) and sides[side].get("losses") for side in SIDES):
        return "-"
    result = agreement(sides["deepspeed"]["losses"], sides["ds"]["losses"], entry.get("deterministic", True))
    diff = "" if result["max_diff"] is None else f"max diff {result['max_diff']:.2g}"
    if result["agree"] is None:
        return f"n/a ({result['why']}; {diff})"
    return f"yes ({diff})" if result["agree"] else f"**no** ({result['why']}; {diff})"


def _wall(entry: dict[str, Any]) -> str:
    walls = [entry.get("sides", {}).get(side, {}).get("wall_s") for side in SIDES]
    return " / ".join("-" if wall is None else f"{wall:.0f}" for wall in walls)


def markdown_table(results: dict[str, Any]) -> str:
    """One row per program: each side's outcome, first and last loss, whether the losses agree, wall seconds."""
    header = (
        "| program | source | DeepSpeed 0.19.8 | ds | losses DeepSpeed: first → last (n) | losses ds | "
        "agree | wall s DeepSpeed / ds |\n| --- | --- | --- | --- | --- | --- | --- | ---: |"
    )
    rows = []
    for name, entry in results.get("programs", {}).items():
        sides = entry.get("sides", {})
        rows.append(
            f"| {name} | {entry.get('source', '')} | {_status(sides.get('deepspeed'))} | {_status(sides.get('ds'))} "
            f"| {_losses(sides.get('deepspeed'))} | {_losses(sides.get('ds'))} | {_agree(entry)} | {_wall(entry)} |"
        )
    return "\n".join([header, *rows])


def notes_list(results: dict[str, Any]) -> str:
    """A bullet per program with its notes (what the recipe changed), to sit under the table."""
    return "\n".join(
        f"- **{name}**: {entry['notes']}" for name, entry in results.get("programs", {}).items() if entry.get("notes")
    )
