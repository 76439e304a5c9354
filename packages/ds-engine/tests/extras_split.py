"""Which test modules the all-extras session may leave to the plain one, and the guard that keeps that true.

CI runs this suite twice: `pkg(target='ds-engine')` (ds-engine alone, none of its extras) and
`pkg(ds-engine-all)` (`ds-engine[all]` plus transformers). A module listed in `runs_without_extras.txt`
never looks up an extra (`EXTRAS`): it runs the same code in both sessions, so the all-extras session
passes `--only-extras` and deselects it. Every other module, new ones included, runs in both (the plain
session runs everything, so no test is left to neither).

The list is kept honest where it can be checked: without the extras installed, a lookup of one (an
`import`, `importlib.util.find_spec`, `pytest.importorskip`) goes through `sys.meta_path`, where
`ExtraLookups` sees it. In `pkg(target='ds-engine')` a listed module whose collection or test looks an
extra up fails, naming the module and the extra: take it off the list, and the all-extras session runs
it again. (With the extras installed an earlier test may already have imported them, so no lookup
reaches the finder; the check then passes vacuously, which is why the plain session is the one to trust.)
"""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import pytest

HERE = Path(__file__).parent
LIST_FILE = HERE / "runs_without_extras.txt"
#: What `ds-engine[all]` and the all-extras session add over ds-engine alone (noxfile.py: the extras'
#: siblings, and transformers from TEST_REQUIREMENTS_WITH_EXTRAS).
EXTRAS = frozenset({"ds_zero", "ds_pipe", "ds_parallel", "transformers"})
ONLY_EXTRAS = "--only-extras"


def read_list(path: Path = LIST_FILE) -> frozenset[str]:
    """The listed module paths (relative to tests/, `/`-separated); blank lines and `#` comments skipped."""
    entries = {line.split("#", 1)[0].strip() for line in path.read_text().splitlines()}
    return frozenset(e for e in entries if e)


def module_key(path: Path) -> str:
    return path.resolve().relative_to(HERE.resolve()).as_posix()


class ExtraLookups(importlib.abc.MetaPathFinder):
    """Records every lookup of an extra's top-level name, under the context it happened in; finds nothing."""

    def __init__(self, names: frozenset[str] = EXTRAS) -> None:
        self.names = names
        self.context: str | None = None
        self.seen: dict[str, set[str]] = {}

    def find_spec(self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None) -> None:
        top = fullname.partition(".")[0]
        if self.context is not None and top in self.names:
            self.seen.setdefault(self.context, set()).add(top)
        return None

    def pop(self, context: str) -> set[str]:
        return self.seen.pop(context, set())


_finder = ExtraLookups()
_listed: frozenset[str] = frozenset()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        ONLY_EXTRAS,
        action="store_true",
        help="deselect the modules in runs_without_extras.txt (the ds-engine-alone session runs them)",
    )


def pytest_configure(config: pytest.Config) -> None:
    global _listed
    _listed = read_list()
    missing = sorted(e for e in _listed if not (HERE / e).is_file())
    if missing:
        raise pytest.UsageError(f"{LIST_FILE.name} lists test modules that do not exist: {missing}")
    if _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _finder in sys.meta_path:
        sys.meta_path.remove(_finder)


def _key(path: Path) -> str | None:
    try:
        return module_key(path)
    except ValueError:  # not under tests/
        return None


def _message(key: str, looked_up: set[str]) -> str:
    return (
        f"{key} is listed in tests/{LIST_FILE.name} (run only without extras) but looked up "
        f"{sorted(looked_up)}: take it off the list, so that pkg(ds-engine-all) runs it with the extras"
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> Iterator[None]:
    key = _key(collector.path) if isinstance(collector, pytest.Module) else None
    if key is None:
        yield
        return
    _finder.context = f"collect:{key}"
    try:
        outcome = yield
    finally:
        _finder.context = None
    report = outcome.get_result()
    # A module-level skip leaves no test to report it on: the collection itself fails.
    if key in _listed and not report.result and (looked_up := _finder.pop(f"collect:{key}")):
        report.outcome = "failed"
        report.longrepr = _message(key, looked_up)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption(ONLY_EXTRAS):
        return
    keep, drop = [], []
    for item in items:
        (drop if _key(item.path) in _listed else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _finder.context = item.nodeid
    try:
        yield
    finally:
        _finder.context = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    key = _key(item.path)
    if report.when != "teardown" or key not in _listed:
        return
    looked_up = _finder.pop(item.nodeid) | _finder.pop(f"collect:{key}")
    if looked_up:
        report.outcome = "failed"
        report.longrepr = _message(key, looked_up)
