"""tools/deepspeed_unit_tests.py without DeepSpeed: outcomes from the event stream, the comparison, the table,
group discovery, and the supervisor's time limit on a made-up test tree whose tests hang or kill their process.

The supervisor exists because DeepSpeed's harness can wedge a pytest process past pytest-timeout (see
tools/_dsunit_run.py); the hanging test here blocks SIGALRM, so only the outside kill can end it, the test
after it must still run, and neither the JIT build lock it held nor a compiler it started in a process group
of its own (as ninja does) may outlive it.
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

import _dsunit_report as report  # noqa: E402 - tools/ is a script folder, not a package
from _dsunit_run import run_group  # noqa: E402
from deepspeed_unit_tests import discover_groups  # noqa: E402


def _events(*events: dict) -> report.Progress:
    progress = report.Progress()
    for event in events:
        progress.feed(json.dumps(event))
    return progress


def _test(nodeid: str, *phases: tuple[str, str, str], xfail: bool = False) -> list[dict]:
    reports = [
        {"event": "report", "nodeid": nodeid, "when": w, "outcome": o, "message": m, "xfail": xfail}
        for w, o, m in phases
    ]
    return [{"event": "start", "nodeid": nodeid, "time": 1.0}, *reports, {"event": "finish", "nodeid": nodeid}]


def test_phase_reports_become_one_outcome_per_test() -> None:
    progress = _events(
        *_test("a.py::ok", ("setup", "passed", ""), ("call", "passed", ""), ("teardown", "passed", "")),
        *_test("a.py::bad", ("setup", "passed", ""), ("call", "failed", "AssertionError: 1 != 2")),
        *_test("a.py::fixture", ("setup", "failed", "RuntimeError: no store"), ("teardown", "passed", "")),
        *_test("a.py::skip", ("setup", "skipped", "needs 4 ranks"), ("teardown", "passed", "")),
        *_test("a.py::xfail", ("call", "skipped", "known"), xfail=True),
        *_test("a.py::slow", ("call", "failed", "Failed: Timeout (>5.0s) from pytest-timeout.")),
        *_test("a.py::teardown", ("call", "passed", ""), ("teardown", "failed", "OSError: busy")),
        *_test("a.py::both", ("call", "failed", "ValueError: x"), ("teardown", "failed", "OSError: busy")),
    )
    assert progress.outcomes == {
        "a.py::ok": {"outcome": "passed", "message": ""},
        "a.py::bad": {"outcome": "failed", "message": "AssertionError: 1 != 2"},
        "a.py::fixture": {"outcome": "error", "message": "RuntimeError: no store"},
        "a.py::skip": {"outcome": "skipped", "message": "needs 4 ranks"},
        "a.py::xfail": {"outcome": "skipped", "message": "xfail: known"},
        "a.py::slow": {"outcome": "timeout", "message": "Failed: Timeout (>5.0s) from pytest-timeout."},
        "a.py::teardown": {"outcome": "error", "message": "OSError: busy"},
        "a.py::both": {"outcome": "failed", "message": "ValueError: x"},
    }
    assert progress.running is None
    assert report.counts(progress.outcomes) == {"passed": 1, "failed": 2, "error": 2, "skipped": 2, "timeout": 1}


def test_a_test_without_finish_is_running_and_is_ended_by_the_supervisor() -> None:
    progress = _events(
        *_test("m.py::first", ("call", "passed", "")),
        {"event": "collect_error", "nodeid": "broken.py", "message": "ImportError: no module x"},
        {"event": "start", "nodeid": "m.py::hangs", "time": 42.0},
        {"event": "report", "nodeid": "m.py::hangs", "when": "setup", "outcome": "passed", "message": ""},
    )
    progress.feed('{"event": "report", "nodeid": "m.py::hangs", "when": "ca')  # cut short by the kill
    assert (progress.running, progress.started_at) == ("m.py::hangs", 42.0)
    assert progress.end_running("timeout", "killed") == "m.py::hangs"
    assert progress.running is None and progress.end_running("crashed", "x") is None
    assert progress.outcomes["m.py::hangs"] == {"outcome": "timeout", "message": "killed"}
    assert progress.outcomes["broken.py"] == {"outcome": "error", "message": "collection: ImportError: no module x"}


def test_compare_counts_the_baselines_passes_and_explains_each_miss() -> None:
    deepspeed = {
        "runtime": {
            "t.py::a": {"outcome": "passed", "message": ""},
            "t.py::b": {"outcome": "passed", "message": ""},
            "t.py::c": {"outcome": "failed", "message": "x"},
            "u.py::d": {"outcome": "passed", "message": ""},
        },
        "v1": {"z.py::e": {"outcome": "passed", "message": ""}, "z.py::f": {"outcome": "skipped", "message": ""}},
        "ops": {"o.py::g": {"outcome": "skipped", "message": ""}},
    }
    ds = {
        "runtime": {
            "t.py::a": {"outcome": "passed", "message": ""},
            "t.py::b": {"outcome": "timeout", "message": "no result after 180s"},
            "t.py::c": {"outcome": "passed", "message": ""},
            "u.py": {"outcome": "error", "message": "collection: ImportError: y"},
        },
        "v1": {"z.py::e": {"outcome": "passed", "message": ""}},
    }
    assert report.pass_counts(ds, deepspeed) == [("ops", 0, 0), ("runtime", 3, 1), ("v1", 1, 1)]
    text = report.compare(ds, deepspeed)
    lines = text.splitlines()
    assert lines[1].split() == ["ops", "0", "0", "-"]
    assert lines[2].split() == ["runtime", "3", "1", "33%"]
    assert lines[4].split() == ["all", "4", "2", "50%"]
    assert "  t.py::b: timeout no result after 180s" in lines
    assert "  u.py::d: error collection: ImportError: y" in lines
    assert not any("t.py::c" in line or "z.py::e" in line for line in lines)

    table = report.markdown_table(ds, deepspeed)
    assert table.splitlines() == [
        "| group | DeepSpeed passes | ds passes | share |",
        "| --- | ---: | ---: | ---: |",
        "| ops | 0 | 0 | - |",
        "| runtime | 3 | 1 | 33% |",
        "| v1 | 1 | 1 | 100% |",
        "| **all** | **4** | **2** | **50%** |",
    ]


def test_groups_are_the_folders_of_tests_unit_that_hold_tests(tmp_path: Path) -> None:
    for path in ("v1/zero/test_zero.py", "runtime/test_a.py", "helpers/util.py", "__pycache__/test_x.py"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / "common.py").write_text("")
    assert discover_groups(tmp_path) == ["runtime", "v1"]


HANGING_TESTS = """
import os
import signal
import subprocess
import time


def test_a_passes():
    pass


def test_b_hangs_where_pytest_timeout_cannot_reach():
    lock = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "some_op", "lock")
    os.makedirs(os.path.dirname(lock))
    open(lock, "w").close()  # as torch's JIT build holds it while building
    # a compiler in a process group of its own, as ninja starts them
    child = subprocess.Popen(["sleep", "600"], process_group=0)
    with open(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "child.pid"), "w") as f:
        f.write(str(child.pid))
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(600)


def test_c_passes():
    pass


def test_d_kills_its_process():
    os._exit(3)


def test_e_too_slow_for_pytest_timeout():
    time.sleep(600)


def test_f_fails():
    assert 1 == 2
"""


@pytest.mark.timeout(120)
def test_the_supervisor_kills_a_wedged_test_and_goes_on_with_the_rest(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "unit" / "grp").mkdir(parents=True)
    (tests / "unit" / "grp" / "test_hangs.py").write_text(textwrap.dedent(HANGING_TESTS))
    extensions = tmp_path / "ext"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(extensions)}
    run = tmp_path / "runs"
    outcomes = run_group(
        Path(sys.executable), tests, "grp", run, env, limit_s=2, grace_s=2, poll_s=0.2, extensions_dir=extensions
    )
    assert (extensions / "some_op").is_dir() and not (extensions / "some_op" / "lock").exists()
    child = int((extensions / "child.pid").read_text())
    assert not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
    by_name = {nodeid.rsplit("::", 1)[1]: r["outcome"] for nodeid, r in outcomes.items()}
    assert by_name == {
        "test_a_passes": "passed",
        "test_b_hangs_where_pytest_timeout_cannot_reach": "timeout",
        "test_c_passes": "passed",
        "test_d_kills_its_process": "crashed",
        "test_e_too_slow_for_pytest_timeout": "timeout",
        "test_f_fails": "failed",
    }
    hung = outcomes["unit/grp/test_hangs.py::test_b_hangs_where_pytest_timeout_cannot_reach"]
    assert "killed from outside" in hung["message"]
    slow = outcomes["unit/grp/test_hangs.py::test_e_too_slow_for_pytest_timeout"]
    assert "pytest-timeout" in slow["message"]


RESUMABLE = """
import os
import time


def test_a_runs_once():
    with open(os.environ["RUN_LOG"], "a") as f:
        f.write("a\\n")


def test_b_stalls_the_first_time():
    if not os.path.exists(os.environ["RUN_LOG"] + ".second"):
        time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_resume_keeps_the_results_and_runs_again_what_had_none(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "unit" / "grp").mkdir(parents=True)
    (tests / "unit" / "grp" / "test_resume.py").write_text(textwrap.dedent(RESUMABLE))
    run_log = tmp_path / "ran.txt"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RUN_LOG": str(run_log)}
    first = run_group(Path(sys.executable), tests, "grp", tmp_path / "runs", env, limit_s=2, grace_s=1, poll_s=0.2)
    assert [r["outcome"] for r in first.values()] == ["passed", "timeout"]
    (tmp_path / "ran.txt.second").write_text("")
    again = run_group(
        Path(sys.executable), tests, "grp", tmp_path / "runs", env, limit_s=2, grace_s=1, poll_s=0.2, resume=True
    )
    assert [r["outcome"] for r in again.values()] == ["passed", "passed"]
    assert run_log.read_text() == "a\n"  # the test with a result did not run again
