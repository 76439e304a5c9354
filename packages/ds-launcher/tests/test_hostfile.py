"""Hostfile parsing: a table of good inputs with their pools, bad inputs with their exact messages."""

from __future__ import annotations

from pathlib import Path

import pytest

from ds_launcher import HostfileError, fetch_hostfile, parse_hostfile

EXPECTED = "expected 'hostname slots=N', e.g. 'worker-0 slots=4'"

GOOD = [
    ("worker-0 slots=4\nworker-1 slots=4\n", {"worker-0": 4, "worker-1": 4}),
    ("# cluster\n\nworker-0\tslots=2\n   worker-1 slots=8   # the big one\n", {"worker-0": 2, "worker-1": 8}),
    ("node1 slots=2 max_slots=4\n", {"node1": 2}),
    ("10.0.0.2 slots=1\n10.0.0.1 slots=3", {"10.0.0.2": 1, "10.0.0.1": 3}),
    ("b slots=1\na slots=2\n", {"b": 1, "a": 2}),
]

BAD = [
    (
        "worker-0 slots=4\nworker-0 slots=2\n",
        "hf:2: host 'worker-0' is already listed on line 1; list each host once with its total slot count",
    ),
    (
        "# header\n\na slots=1\nb slots=1\na slots=1\n",
        "hf:5: host 'a' is already listed on line 3; list each host once with its total slot count",
    ),
    ("worker-0 slot=2\n", f"hf:1: 'worker-0 slot=2' has no slot count; {EXPECTED}"),
    ("worker-0\n", f"hf:1: 'worker-0' has no slot count; {EXPECTED}"),
    ("a slots=1\nworker-0 slots=0\n", "hf:2: host 'worker-0' has slots=0; give at least 1 slot or remove the line"),
    ("worker-0 slots=-1\n", f"hf:1: slot count '-1' of host 'worker-0' is not a whole number; {EXPECTED}"),
    ("worker-0 slots=two\n", f"hf:1: slot count 'two' of host 'worker-0' is not a whole number; {EXPECTED}"),
    ("worker-0 slots=\n", f"hf:1: slot count '' of host 'worker-0' is not a whole number; {EXPECTED}"),
    ("worker-0 slots=4 extra\n", f"hf:1: unexpected 'extra' after the slot count; {EXPECTED}"),
    ("slots=4\n", f"hf:1: bad host name 'slots=4'; {EXPECTED}"),
    ("", "hf: no hosts found; expected lines like 'worker-0 slots=4'"),
    ("# only a comment\n\n   \n", "hf: no hosts found; expected lines like 'worker-0 slots=4'"),
]


@pytest.mark.parametrize(("text", "pool"), GOOD)
def test_good_hostfiles(text: str, pool: dict[str, int]) -> None:
    parsed = parse_hostfile(text, source="hf")
    assert parsed == pool
    assert list(parsed) == list(pool)  # file order is node-rank order


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_hostfiles(text: str, message: str) -> None:
    with pytest.raises(HostfileError) as info:
        parse_hostfile(text, source="hf")
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_fetch_reads_the_file_and_names_it_in_errors(tmp_path: Path) -> None:
    good = tmp_path / "hostfile"
    good.write_text("worker-0 slots=2\n")
    assert fetch_hostfile(str(good)) == {"worker-0": 2}
    bad = tmp_path / "bad"
    bad.write_text("worker-0 slots=2\nworker-1\n")
    with pytest.raises(HostfileError, match=rf"^{bad}:2: 'worker-1' has no slot count"):
        fetch_hostfile(str(bad))


def test_fetch_missing_or_directory(tmp_path: Path) -> None:
    missing = tmp_path / "nope"
    with pytest.raises(HostfileError) as info:
        fetch_hostfile(str(missing))
    assert str(info.value) == (
        f"--hostfile '{missing}' does not exist; pass an existing file, or omit --hostfile "
        "to use this host's local resources"
    )
    with pytest.raises(HostfileError, match="is a directory; pass the hostfile itself"):
        fetch_hostfile(str(tmp_path))


def test_no_hostfile_given_and_no_default_means_local() -> None:
    if Path("/job/hostfile").exists():
        pytest.skip("this machine has a /job/hostfile")
    assert fetch_hostfile(None) is None
