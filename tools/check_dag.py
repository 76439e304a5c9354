#!/usr/bin/env python3
"""Check the package DAG from the imports (run by `nox -s dag`).

Fails (exit 1) on:
- a sibling import the importing package does not declare (hard dependency or extra);
- a module-level import of an optional sibling (it must be imported inside a function);
- an import of a sibling's private module (`ds_comm._dist_init`): siblings meet through `__init__`;
- a cycle among the declared sibling dependencies;
- a sibling range that excludes that sibling's current `__about__` version;
- an import against ds-engine's layer order or across its border, a circle of files in ds-engine or
  ds-zero (`tools/_layer_check.py`).

Usage: python tools/check_dag.py [REPO_ROOT]
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _layer_check import check_circles, check_layers, type_checking_nodes  # noqa: E402


def _name(req: str) -> str:
    return re.split(r"[\s<>=!~;\[]", req.strip(), maxsplit=1)[0].lower()


def _version(pkg_dir: Path) -> Version | None:
    for about in (pkg_dir / "src").glob("*/__about__.py"):
        match = re.search(r'__version__\s*=\s*["\']([^"\']+)', about.read_text())
        if match:
            return Version(match.group(1))
    return None


def _module_level_nodes(tree: ast.Module) -> set[int]:
    """ids of import nodes that run at import time (not inside a def or lambda)."""
    eager: set[int] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, (ast.Import, ast.ImportFrom)) and not in_function:
                eager.add(id(child))
            visit(child, nested)

    visit(tree, False)
    return eager


def main(root: Path) -> int:
    problems: list[str] = []
    notes: list[str] = []
    pyprojects = sorted(root.glob("packages/*/pyproject.toml"))
    projects = {}
    for pyproject in pyprojects:
        project = tomllib.loads(pyproject.read_text()).get("project", {})
        projects[project.get("name", pyproject.parent.name).lower()] = (pyproject.parent, project)
    versions = {name: _version(path) for name, (path, _) in projects.items()}

    graph: dict[str, set[str]] = {}
    for me, (pkg_dir, project) in projects.items():
        hard = {_name(r) for r in project.get("dependencies", [])}
        extra = {_name(r) for reqs in project.get("optional-dependencies", {}).values() for r in reqs} - hard - {me}
        graph[me] = {d for d in hard if d in projects}
        for req_text in [
            *project.get("dependencies", []),
            *(r for reqs in project.get("optional-dependencies", {}).values() for r in reqs),
        ]:
            req = Requirement(req_text)
            dep = req.name.lower()
            if dep in projects and dep != me and versions.get(dep) is not None:
                if not req.specifier.contains(versions[dep], prereleases=True):
                    problems.append(f"{me}: requires {req_text!r} but {dep} is at {versions[dep]}")
        for f in sorted((pkg_dir / "src").rglob("*.py")):
            tree = ast.parse(f.read_text(), str(f))
            eager, guarded = _module_level_nodes(tree), type_checking_nodes(tree)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    mods = [node.module]
                else:
                    continue
                for mod in mods:
                    top = mod.split(".")[0]
                    if not top.startswith("ds_"):
                        continue
                    dist = top.replace("_", "-")
                    if dist == me or id(node) in guarded:
                        continue
                    where = f"{f.relative_to(root)}:{node.lineno}"
                    if any(part.startswith("_") and not part.startswith("__") for part in mod.split(".")[1:]):
                        problems.append(f"{me}: imports private {mod} at {where}; use {top}'s public API")
                    if dist in hard:
                        continue
                    if dist in extra:
                        if id(node) in eager:
                            problems.append(
                                f"{me}: optional {dist} imported at module level at {where}; "
                                "import it inside the function that needs it"
                            )
                        else:
                            notes.append(f"{me}: optional {dist} imported lazily at {where}")
                    else:
                        problems.append(f"{me}: UNDECLARED {dist} imported at {where}")

    # Cycles among hard sibling dependencies.
    state: dict[str, int] = {}

    def dfs(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, ()):
            if state.get(nxt) == 1:
                problems.append("cycle: " + " -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif nxt not in state:
                dfs(nxt, [*stack, nxt])
        state[node] = 2

    for name in graph:
        if name not in state:
            dfs(name, [name])

    debt = root / "tools" / "layer_debt.txt"
    engine_src = root / "packages" / "ds-engine" / "src" / "ds_engine"
    for found_problems, found_notes in (
        check_layers(engine_src, debt),
        check_circles(engine_src, debt),
        check_circles(root / "packages" / "ds-zero" / "src" / "ds_zero", debt),
    ):
        problems += found_problems
        notes += found_notes

    for line in notes:
        print(line)
    for line in problems:
        print(line)
    print(f"dag: {len(projects)} packages, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1] if len(sys.argv) > 1 else ".")))
