"""A pytest plugin that writes each test's progress to a JSON-lines file as it happens, for a supervisor.

tools/deepspeed_unit_tests.py runs DeepSpeed's tests in a pytest process it can kill: DeepSpeed's harness runs
the ranks of a test in a process pool, and a rank that dies (a `pytest.fail` raised in a pool worker) or hangs
in a collective can wedge the pytest process for good, past any in-process timeout. The supervisor reads this
file while pytest runs: a test that started and did not finish within its limit is killed from outside and
recorded as timed out, and pytest is started again on the tests not run yet.

Environment:
    DSUNIT_EVENTS: the file to append events to (one JSON object a line, flushed at once).
    DSUNIT_DONE: optional; a file of node ids, one a line, that an earlier attempt already ran: they are
        deselected, so a restart goes on where the killed process stopped.

Events: `{"event": "start", "nodeid", "time"}`, `{"event": "report", "nodeid", "when", "outcome", "message",
"xfail"}` per phase, `{"event": "finish", "nodeid", "time"}`, `{"event": "collect_error", "nodeid", "message"}`,
`{"event": "interrupted", "message"}` (pytest.exit or Ctrl-C) and `{"event": "session_finish", "exitstatus"}`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

_STREAM: Any = None


def _write(**event: Any) -> None:
    global _STREAM
    path = os.environ.get("DSUNIT_EVENTS")
    if not path:
        return
    if _STREAM is None:
        _STREAM = open(path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for the whole session
    _STREAM.write(json.dumps(event) + "\n")
    _STREAM.flush()


def _first_line(text: str) -> str:
    for line in text.strip().splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def _message(report: Any) -> str:
    """The one line that says why: the crash message of a failure, the reason of a skip."""
    longrepr = report.longrepr
    if longrepr is None:
        return ""
    if isinstance(longrepr, tuple) and len(longrepr) == 3:  # a skip: (path, line, reason)
        return _first_line(str(longrepr[2]))
    crash = getattr(longrepr, "reprcrash", None)
    if crash is not None and getattr(crash, "message", None):
        return _first_line(crash.message)
    return _first_line(str(longrepr))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    done_file = os.environ.get("DSUNIT_DONE")
    if not done_file or not Path(done_file).exists():
        return
    done = set(Path(done_file).read_text(encoding="utf-8").splitlines())
    keep = [item for item in items if item.nodeid not in done]
    dropped = [item for item in items if item.nodeid in done]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write(event="collect_error", nodeid=report.nodeid, message=_message(report))


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write(event="start", nodeid=nodeid, time=time.time())


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _write(
        event="report",
        nodeid=report.nodeid,
        when=report.when,
        outcome=report.outcome,
        message=_message(report),
        xfail=hasattr(report, "wasxfail"),
    )


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    _write(event="finish", nodeid=nodeid, time=time.time())


def pytest_keyboard_interrupt(excinfo: Any) -> None:
    # pytest.exit() lands here too (DeepSpeed's harness calls it when a test's ranks outlive its timeout).
    _write(event="interrupted", message=_first_line(str(excinfo.value)) or excinfo.typename)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _write(event="session_finish", exitstatus=int(exitstatus))
