"""`tools/check_dag.py` holds ds-engine to its layer order and its border (`tools/_layer_check.py`).

The real tree passes; a copy with one planted wrong-way import (a lower layer importing a higher one, ds's
own code importing a DeepSpeed path, an import hidden inside a function, two rooms importing each other)
fails, naming the file; an import under `if TYPE_CHECKING:` is no edge; a debt line that no longer matches
an import fails, so the debt list only shrinks.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "tools") not in sys.path:
    sys.path.insert(0, str(ROOT / "tools"))

from _layer_check import LAYERS, check_circles, check_layers  # noqa: E402 - tools/ is a script folder, not a package

ENGINE_SRC = ROOT / "packages" / "ds-engine" / "src" / "ds_engine"
ZERO_SRC = ROOT / "packages" / "ds-zero" / "src" / "ds_zero"
DEBT = ROOT / "tools" / "layer_debt.txt"


@pytest.fixture
def engine_copy(tmp_path: Path) -> Path:
    """A copy of ds-engine's source and the debt list, laid out as a repository check_dag.py reads."""
    pkg = tmp_path / "packages" / "ds-engine"
    shutil.copytree(ENGINE_SRC, pkg / "src" / "ds_engine", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "packages" / "ds-engine" / "pyproject.toml", pkg / "pyproject.toml")
    zero = tmp_path / "packages" / "ds-zero"
    shutil.copytree(ZERO_SRC, zero / "src" / "ds_zero", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "packages" / "ds-zero" / "pyproject.toml", zero / "pyproject.toml")
    (tmp_path / "tools").mkdir()
    shutil.copy(DEBT, tmp_path / "tools" / "layer_debt.txt")
    return tmp_path


def _plant(root: Path, module: str, text: str) -> None:
    path = root / "packages" / "ds-engine" / "src" / "ds_engine" / module
    path.write_text(path.read_text() + "\n" + text + "\n")


def _check(root: Path) -> list[str]:
    engine, debt = root / "packages" / "ds-engine" / "src" / "ds_engine", root / "tools" / "layer_debt.txt"
    return check_layers(engine, debt)[0] + check_circles(engine, debt)[0]


def test_the_real_tree_keeps_its_layers() -> None:
    problems, notes = check_layers(ENGINE_SRC, DEBT)
    assert problems == []
    for src in (ENGINE_SRC, ZERO_SRC):
        circle_problems, circle_notes = check_circles(src, DEBT)
        assert circle_problems == []
        notes += circle_notes
    # every layer the check ranks exists as a package
    assert all((ENGINE_SRC / name / "__init__.py").is_file() for names in LAYERS for name in names)
    assert all("known debt" in note for note in notes)


def test_a_lower_layer_importing_a_higher_one_fails(engine_copy: Path) -> None:
    _plant(engine_copy, "_plan/plan.py", "from ds_engine._setup.initialize import initialize  # planted")
    wrong_way, circle, rooms = _check(engine_copy)  # initialize imports the plan: a circle too, of rooms as well
    assert "ds_engine._plan.plan imports ds_engine._setup.initialize" in wrong_way and "_plan/plan.py" in wrong_way
    assert circle.startswith("layers: files import each other in a circle: ") and "ds_engine._plan.plan" in circle
    assert rooms.startswith("layers: rooms import each other in a circle: ") and "ds_engine._setup" in rooms


def test_a_wrong_way_import_inside_a_function_fails(engine_copy: Path) -> None:
    _plant(
        engine_copy, "config/_checks.py", "def planted():\n    from ds_engine._engine import engine\n    return engine"
    )
    problem, *_circles = _check(engine_copy)
    assert "ds_engine.config._checks imports ds_engine._engine.engine" in problem


def test_ds_code_importing_a_deepspeed_path_fails(engine_copy: Path) -> None:
    _plant(engine_copy, "_step/steppers.py", "from ds_engine.utils import groups  # planted")
    problem, rooms = _check(engine_copy)  # utils re-exports _step's accessors: the two rooms now form a circle
    assert "imports DeepSpeed's path ds_engine.utils.groups" in problem
    assert rooms == "layers: rooms import each other in a circle: ds_engine._step ds_engine.utils"


def test_an_import_for_type_checking_only_is_no_edge(engine_copy: Path) -> None:
    _plant(engine_copy, "_plan/plan.py", "if TYPE_CHECKING:\n    from ds_engine._engine.engine import DeepSpeedEngine")
    assert _check(engine_copy) == []


def test_a_circle_of_files_fails_even_through_a_lazy_import(engine_copy: Path) -> None:
    # optimizers imports muon at module level; muon importing optimizers back, even lazily, closes a circle
    _plant(
        engine_copy,
        "_optim/muon.py",
        "def planted():\n    from ds_engine._optim import optimizers\n    return optimizers",
    )
    (problem,) = _check(engine_copy)
    assert problem == "layers: files import each other in a circle: ds_engine._optim.muon ds_engine._optim.optimizers"


def test_a_circle_of_rooms_fails_without_a_circle_of_files(engine_copy: Path) -> None:
    # runtime/engine.py imports utils.bwc; utils/bwc.py importing runtime.dataloader closes no file circle
    # (dataloader imports neither), but the rooms runtime and utils now import each other
    _plant(engine_copy, "utils/bwc.py", "from ds_engine.runtime import dataloader  # planted")
    (problem,) = _check(engine_copy)
    assert problem == "layers: rooms import each other in a circle: ds_engine.runtime ds_engine.utils"


def test_a_stale_debt_line_fails(engine_copy: Path) -> None:
    debt = engine_copy / "tools" / "layer_debt.txt"
    debt.write_text(debt.read_text() + "ds_engine._plan.plan -> ds_engine._engine.engine\n")
    (problem,) = _check(engine_copy)
    assert "ds_engine._plan.plan -> ds_engine._engine.engine is listed" in problem and "no longer imported" in problem


def test_check_dag_exits_1_on_a_planted_wrong_way_import(engine_copy: Path) -> None:
    script = ROOT / "tools" / "check_dag.py"
    clean = subprocess.run([sys.executable, str(script), str(engine_copy)], capture_output=True, text=True)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    _plant(engine_copy, "_step/autocast.py", "from ds_engine._checkpoint import checkpoint  # planted")
    planted = subprocess.run([sys.executable, str(script), str(engine_copy)], capture_output=True, text=True)
    assert planted.returncode == 1
    assert "ds_engine._step.autocast imports ds_engine._checkpoint.checkpoint" in planted.stdout
