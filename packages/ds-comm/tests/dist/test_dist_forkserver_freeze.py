"""Ranks start from a forkserver whose imports are frozen out of garbage collection (`_forkserver_preload`)."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

from ds_comm.testing import run_ranks


def _rank_view(rank: int, world: int) -> dict[str, object]:
    return {"frozen": gc.get_freeze_count(), "torch_preloaded": "torch" in sys.modules}


def test_each_rank_inherits_the_servers_frozen_imports() -> None:
    (view,) = run_ranks(1, _rank_view, timeout_s=120)
    assert view["torch_preloaded"]
    # torch alone is a few hundred thousand objects; a rank whose server froze nothing reports 0.
    assert view["frozen"] > 100_000, view


def _preloaded(rank: int, world: int, names: list[str]) -> dict[str, bool]:
    return {name: name in sys.modules for name in names}


_PRELOAD_SCRIPT = """
import sys
sys.path.insert(0, {here!r})
from ds_comm.testing import preload_in_ranks, run_ranks
from test_dist_forkserver_freeze import _preloaded
preload_in_ranks("xml.dom.minidom", "no_such_module_for_ds_tests")
(view,) = run_ranks(1, _preloaded, ["xml.dom.minidom", "wave"], timeout_s=120)
print(view)
"""


def test_a_suites_preloaded_modules_are_imported_in_every_rank() -> None:
    # Its own interpreter: the forkserver reads the preload list once, when it starts, and this
    # pytest process may have started it already. A module that does not exist is skipped.
    code = _PRELOAD_SCRIPT.format(here=str(Path(__file__).parent))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    # preloaded: in the rank without the rank importing it; never named: absent (the check can fail).
    assert done.stdout.strip().splitlines()[-1] == "{'xml.dom.minidom': True, 'wave': False}", done.stdout
