"""The split between the ds-engine-alone and all-extras sessions (`extras_split`): the finder sees lookups, the
list parses and names only real in-process modules."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from extras_split import HERE, LIST_FILE, ExtraLookups, read_list


def test_finder_records_imports_and_find_spec_of_a_watched_name_under_its_context() -> None:
    finder = ExtraLookups(frozenset({"ds_no_such_extra"}))
    sys.meta_path.insert(0, finder)
    try:
        finder.context = "collect:test_x.py"
        assert importlib.util.find_spec("ds_no_such_extra") is None
        finder.context = "test_y.py::test_z"
        with pytest.raises(ModuleNotFoundError):
            import ds_no_such_extra.sub  # noqa: F401
        finder.context = None
        assert importlib.util.find_spec("ds_no_such_extra") is None  # outside any test: not recorded
        assert importlib.util.find_spec("ds_also_missing") is None  # not watched
    finally:
        sys.meta_path.remove(finder)
    assert finder.pop("collect:test_x.py") == {"ds_no_such_extra"}
    assert finder.pop("test_y.py::test_z") == {"ds_no_such_extra"}
    assert finder.seen == {}


def test_list_skips_comments_and_names_existing_modules_outside_dist(tmp_path: Path) -> None:
    sample = tmp_path / "list.txt"
    sample.write_text("# a comment\n\ntest_a.py  # why\n sub/test_b.py\n")
    assert read_list(sample) == {"test_a.py", "sub/test_b.py"}
    listed = read_list(LIST_FILE)
    assert listed, "the list is empty: the all-extras session would run every module again"
    for entry in listed:
        assert (HERE / entry).is_file(), entry
        assert not entry.startswith("dist/"), f"{entry}: ranks' lookups are out of the check's sight"
