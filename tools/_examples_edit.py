"""The edits a recipe makes to an exported DeepSpeedExamples program: substitutions that refuse to guess.

Every substitution names the exact text it replaces and how many times it must occur. When DeepSpeedExamples
changes that text, the recipe stops with `RecipeError` naming the file and the missing anchor, instead of
running an unedited program (which would try to download, or run for hours) and reporting a misleading result.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

SHIMS = Path(__file__).resolve().parent / "_examples_shims"


class RecipeError(RuntimeError):
    """A recipe's edit does not fit the exported program (its anchor text is missing or ambiguous)."""


def substitute(path: Path, old: str, new: str, count: int = 1) -> None:
    """Replace `old` by `new` in `path`; `old` must occur exactly `count` times (0: at least once, all replaced)."""
    text = path.read_text()
    found = text.count(old)
    if found == 0 or (count and found != count):
        expected = "at least once" if count == 0 else f"{count} time(s)"
        raise RecipeError(f"{path.name}: expected {old!r} {expected}, found it {found} time(s)")
    path.write_text(text.replace(old, new))


def between(text: str, start: str, end: str, where: str = "") -> str:
    """The text after the first `start` up to the next `end` (both must be present)."""
    head = text.find(start)
    if head < 0:
        raise RecipeError(f"{where}: start anchor {start!r} not found")
    head += len(start)
    tail = text.find(end, head)
    if tail < 0:
        raise RecipeError(f"{where}: end anchor {end!r} not found after {start!r}")
    return text[head:tail]


def add_shims(run_dir: Path, *names: str) -> None:
    """Copy shim modules or packages (from tools/_examples_shims) next to the program, where its imports find them."""
    for name in names:
        source = SHIMS / name
        if source.is_dir():
            shutil.copytree(source, run_dir / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.is_file():
            shutil.copy2(source, run_dir / name)
        else:
            raise RecipeError(f"no shim {name!r} in {SHIMS}")


def edit_json(path: Path, changes: dict[str, object], new_keys: bool = False) -> None:
    """Set top-level keys of a JSON config; each key must already be there (a renamed key is an error).

    `new_keys=True` adds keys the config lacks instead, and refuses any it already has (a recipe that sets an
    upstream default explicitly, e.g. `gradient_clipping`, must notice when upstream starts setting it).
    """
    config = json.loads(path.read_text())
    if new_keys:
        present = [key for key in changes if key in config]
        if present:
            raise RecipeError(f"{path.name}: key(s) {present} already set (expected to add them)")
        config.update(changes)
        path.write_text(json.dumps(config, indent=2) + "\n")
        return
    missing = [key for key in changes if key not in config]
    if missing:
        raise RecipeError(f"{path.name}: no key(s) {missing} to change (has {sorted(config)})")
    config.update(changes)
    path.write_text(json.dumps(config, indent=2) + "\n")
