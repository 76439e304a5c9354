"""ds_comm's modules import each other without a cycle, counting imports inside functions too.

A cycle broken by a function-level import still runs both modules half-initialised in some import
order (STYLE: "never break a cycle with a local import; move the code"). `TYPE_CHECKING` imports
do not run and are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import ds_comm

ROOT = Path(ds_comm.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_no_import_cycle_among_ds_comm_modules() -> None:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    graph = {name: _imports(ast.parse(path.read_text()), set(files)) - {name} for name, path in files.items()}
    state: dict[str, str] = {}
    stack: list[str] = []

    def dfs(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt) :] + [nxt]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if nxt not in state:
                dfs(nxt)
        stack.pop()
        state[node] = "done"

    for name in sorted(graph):
        if name not in state:
            dfs(name)
    assert "ds_comm.collectives" not in graph["ds_comm._dist_init"]
