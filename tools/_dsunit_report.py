"""What tools/deepspeed_unit_tests.py concludes from a run: outcomes from the event stream, and the comparison.

Pure functions over plain data (no pytest, no DeepSpeed), so they are tested on made-up events
(tests-integration/test_deepspeed_unit_tests_logic.py).

Results are `{group: {node id: {"outcome": ..., "message": first line of the reason}}}`; an outcome is one of
`OUTCOMES`. `timeout` is a test that outlived its limit (pytest-timeout failed it, or it wedged its pytest
process and was killed from outside); `crashed` is one whose pytest process ended while it ran (DeepSpeed's
harness calls `pytest.exit` when a test's ranks outlive its own timeout; a segfault does the same).
A module that fails to import is one `error` entry under the module's node id.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

OUTCOMES = ("passed", "failed", "error", "skipped", "timeout", "crashed")
Outcome = dict[str, str]
Results = Mapping[str, Mapping[str, Outcome]]


def _is_timeout(message: str) -> bool:
    return "Timeout" in message and "pytest-timeout" in message


def outcome_of(phases: Iterable[Mapping[str, object]]) -> Outcome:
    """One test's outcome from its phase reports (`when`, `outcome`, `message`, `xfail`), as pytest reports it.

    A failure in setup is an `error`, in the call a `failed` (a `timeout` if pytest-timeout raised it), in
    teardown an `error` only if the test had passed. A skip or an expected failure is `skipped`; an
    unexpected pass of an xfail test is `passed` (as JUnit XML records them).
    """
    result: Outcome = {"outcome": "passed", "message": ""}
    for phase in phases:
        when, outcome, message = phase.get("when"), phase.get("outcome"), str(phase.get("message") or "")
        if outcome == "failed":
            if _is_timeout(message):
                kind = "timeout"
            elif when == "call":
                kind = "failed"
            else:
                kind = "error"
            if result["outcome"] in ("passed", "skipped") or kind == "timeout":
                result = {"outcome": kind, "message": message}
        elif outcome == "skipped" and result["outcome"] == "passed":
            reason = f"xfail: {message}" if phase.get("xfail") else message
            result = {"outcome": "skipped", "message": reason}
    return result


@dataclass
class Progress:
    """A group's run so far, fed the plugin's events line by line (tools/_dsunit_plugin/dsunit_events.py)."""

    outcomes: dict[str, Outcome] = field(default_factory=dict)
    running: str | None = None
    """The test that started and has not finished."""
    started_at: float = 0.0
    interrupted: str = ""
    """The message of a pytest.exit / interrupt, if the session was ended early."""
    session_finished: bool = False
    _phases: dict[str, list[dict[str, object]]] = field(default_factory=dict)

    def feed(self, line: str) -> None:
        line = line.strip()
        if not line:
            return
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            return  # a line cut short by a kill
        kind, nodeid = event.get("event"), event.get("nodeid", "")
        if kind == "start":
            self.running, self.started_at = nodeid, float(event.get("time", 0.0))
            self._phases[nodeid] = []
        elif kind == "report":
            self._phases.setdefault(nodeid, []).append(event)
        elif kind == "finish":
            self.outcomes[nodeid] = outcome_of(self._phases.pop(nodeid, []))
            if self.running == nodeid:
                self.running = None
        elif kind == "collect_error":
            self.outcomes[nodeid] = {"outcome": "error", "message": f"collection: {event.get('message', '')}"}
        elif kind == "interrupted":
            self.interrupted = str(event.get("message", ""))
        elif kind == "session_finish":
            self.session_finished = True

    def end_running(self, outcome: str, message: str) -> str | None:
        """Record the test that was running when its process was killed or ended; returns its node id."""
        nodeid = self.running
        if nodeid is None:
            return None
        partial = outcome_of(self._phases.pop(nodeid, []))
        if partial["outcome"] not in ("passed", "skipped"):
            message = f"{message}; before that: {partial['message']}"
        self.outcomes[nodeid] = {"outcome": outcome, "message": message[:300]}
        self.running = None
        return nodeid


def counts(outcomes: Mapping[str, Outcome]) -> dict[str, int]:
    """How many tests ended in each outcome, in `OUTCOMES` order (the ones that occur)."""
    found: dict[str, int] = {}
    for result in outcomes.values():
        found[result["outcome"]] = found.get(result["outcome"], 0) + 1
    return {k: found[k] for k in (*OUTCOMES, *sorted(set(found) - set(OUTCOMES))) if k in found}


def _explain_missing(test: str, here: Mapping[str, Outcome]) -> Outcome:
    """Why a test has no result here: its module failed to collect (that error), or it was not collected."""
    module = test.split("::", 1)[0]
    if here.get(module, {}).get("outcome") == "error":
        return here[module]
    return {"outcome": "not collected", "message": ""}


def _passed(outcomes: Mapping[str, Outcome]) -> list[str]:
    return [t for t, r in outcomes.items() if r["outcome"] == "passed"]


def pass_counts(current: Results, baseline: Results) -> list[tuple[str, int, int]]:
    """Per group of the baseline, in order: (group, baseline passes, of those, passes here)."""
    rows = []
    for group in sorted(baseline):
        passed = _passed(baseline[group])
        here = current.get(group, {})
        rows.append((group, len(passed), sum(here.get(t, {}).get("outcome") == "passed" for t in passed)))
    return rows


def _share(part: int, whole: int) -> str:
    return f"{part / whole:.0%}" if whole else "-"


def compare(current: Results, baseline: Results) -> str:
    """Per group: of the baseline's passes, how many pass here; then every one that does not."""
    lines = [f"{'group':<22}{'baseline passed':>16}{'ds passed':>11}{'share':>8}"]
    rows = pass_counts(current, baseline)
    for group, base, ok in rows:
        lines.append(f"{group:<22}{base:>16}{ok:>11}{_share(ok, base):>8}")
    total_base, total_ok = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines.append(f"{'all':<22}{total_base:>16}{total_ok:>11}{_share(total_ok, total_base):>8}")
    missing: list[str] = []
    for group in sorted(baseline):
        here = current.get(group, {})
        for test in _passed(baseline[group]):
            result = here.get(test) or _explain_missing(test, here)
            if result["outcome"] != "passed":
                missing.append(f"  {test}: {result['outcome']} {result['message']}".rstrip())
    return "\n".join([*lines, "", "Passed by the baseline, not here:", *missing])


def markdown_table(ds: Results, deepspeed: Results) -> str:
    """A markdown table for benchmarks/RESULTS.md: per group, DeepSpeed's passes and how many of them ds passes."""
    rows = pass_counts(ds, deepspeed)
    lines = ["| group | DeepSpeed passes | ds passes | share |", "| --- | ---: | ---: | ---: |"]
    lines += [f"| {group} | {base} | {ok} | {_share(ok, base)} |" for group, base, ok in rows]
    total_base, total_ok = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines.append(f"| **all** | **{total_base}** | **{total_ok}** | **{_share(total_ok, total_base)}** |")
    return "\n".join(lines) + "\n"
