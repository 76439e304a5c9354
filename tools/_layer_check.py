"""The layer order inside ds-engine (DESIGN.md, "Inside ds-engine"), checked from the imports.

ds's own code sits in `_underscore` packages ranked left to right; a module imports only packages to
its left (or its own package). `_optim/` is the lowest layer: `config/` checks an optimizer's and a
schedule's params against their constructors, so it needs them (DESIGN.md drew `config` first; the
note on issue 39 says why the order is `_optim < config`). `_data/` (data efficiency: the data sampler,
curriculum and random-LTD schedulers, the token-dropping layer) and `_linear/` (`deepspeed.linear`'s layers)
need no other layer, and `config/` checks curriculum metrics with `_data`'s rules, so they share `_optim`'s
rank. `__about__`, `_comm`, `_optional` and `_reexport` are leaves any layer may use. Every other
plain-named path (`runtime/`, `utils/`, `comm.py`, ...) is DeepSpeed 0.19.8's path: it may import ds's
layers to re-export them, but ds's own code never imports
it (the border). `explain.py` and `__init__.py` are ds's public faces and sit above everything.

Imports under `if TYPE_CHECKING:` are not edges. Imports inside functions are: a lazy import does not
make a wrong-way dependency right.

Circles of files (a imports b imports ... a, inside-function imports included) fail in every package
`check_circles` is given (ds-engine and ds-zero): a lazy import that dodges a circle is still one. So do
circles of rooms (the package's top-level packages and modules, as a floor plan draws them): `_nvme` importing
`_stage3` while `_stage3` imports `_nvme` is a circle of rooms even when no file imports itself back.

Known wrong-way edges and circles that later steps of issue 39 remove are listed in
`tools/layer_debt.txt` (`importer -> imported`, or `circle: a b c`, one per line). A listed one is
reported but does not fail; a new one fails, and so does a listed one that no longer exists, so the
list only shrinks.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

#: Left to right; names in one tuple share a rank and do not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_optim", "_data", "_linear"),
    ("config",),
    ("_plan",),
    ("_report",),
    ("_parallel",),
    ("_step",),
    ("_checkpoint",),
    ("_engine",),
    ("_pipeline", "_hybrid", "_inference", "_activation_offload"),
    ("_setup",),
)
#: Leaves every layer may import.
LEAVES = frozenset({"__about__", "_comm", "_optional", "_reexport"})
#: ds's public faces above every layer (they may import any layer, and nothing imports them).
FACES = frozenset({"__init__", "explain"})
RANK = {name: rank for rank, names in enumerate(LAYERS) for name in names}


@dataclass(frozen=True)
class Edge:
    importer: str  # dotted module, e.g. ds_engine._plan.plan
    imported: str
    where: str  # path:line

    @property
    def key(self) -> str:
        return f"{self.importer} -> {self.imported}"


def _module_name(path: Path, src: Path) -> str:
    parts = list(path.relative_to(src).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def type_checking_nodes(tree: ast.Module) -> set[int]:
    """ids of every node under an `if TYPE_CHECKING:` (imports there are for type checkers only)."""
    guarded: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            guarded.update(id(child) for child in ast.walk(node))
    return guarded


def _resolve(src: Path, package: str, name: str) -> str:
    """`ds_engine._checkpoint` + `moe_checkpoint` -> the submodule when it exists, else the package."""
    candidate = f"{package}.{name}"
    base = src.joinpath(*candidate.split("."))
    return candidate if base.with_suffix(".py").exists() or base.is_dir() else package


def imports_of(path: Path, src: Path, package: str) -> list[Edge]:
    """Every import of `package` in one file (relative imports resolved), TYPE_CHECKING blocks left out."""
    me = _module_name(path, src)
    tree = ast.parse(path.read_text(), str(path))
    guarded = type_checking_nodes(tree)
    is_pkg = path.name == "__init__.py"
    found: list[Edge] = []
    for node in ast.walk(tree):
        if id(node) in guarded:
            continue
        where = f"{path.relative_to(src.parent)}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import):
            found += [Edge(me, a.name, where) for a in node.names if a.name.split(".")[0] == package]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = me.split(".") if is_pkg else me.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            if target.split(".")[0] != package:
                continue
            found += [Edge(me, _resolve(src, target, a.name), where) for a in node.names]
    return found


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def wrong_way(edge: Edge) -> str | None:
    """Why this edge breaks the layer order, or None."""
    mine, theirs = _top(edge.importer), _top(edge.imported)
    if mine not in RANK or theirs in LEAVES or mine == theirs:
        return None  # DeepSpeed paths and faces may import anything; leaves and the own layer are fine
    if theirs in FACES:
        return f"imports the public face {edge.imported} (import the layer that defines the name)"
    if theirs not in RANK:
        return f"imports DeepSpeed's path {edge.imported} (ds's own code stays inside the border)"
    if RANK[theirs] >= RANK[mine]:
        return f"imports {edge.imported}, a layer not to the left of {mine}"
    return None


def read_debt(debt_file: Path | None) -> set[str]:
    """The listed known edges and circles (comments and blank lines dropped)."""
    if debt_file is None or not debt_file.exists():
        return set()
    return {line.split("#")[0].strip() for line in debt_file.read_text().splitlines() if line.split("#")[0].strip()}


def _room(module: str) -> str | None:
    """The top-level entry of the package that holds `module` (`ds_zero._stage3.optimizer` -> `_stage3`); None
    for the package itself (its `__init__` is the public face, which imports every room)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def circles(src: Path, *, rooms: bool = False) -> list[list[str]]:
    """Every circle in the package at `src`: the strongly connected parts of its import graph, of files, or with
    `rooms` of its top-level packages and modules (two rooms whose files import each other both ways are a
    circle even when no file circle closes)."""
    graph: dict[str, set[str]] = {}
    for path in sorted(src.rglob("*.py")):
        for edge in imports_of(path, src.parent, src.name):
            importer, imported = edge.importer, edge.imported
            if rooms:
                importer, imported = _room(importer), _room(imported)  # type: ignore[assignment]
                if importer is None or imported is None:
                    continue
            if imported != importer:
                graph.setdefault(importer, set()).add(imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def check_circles(src: Path, debt_file: Path | None) -> tuple[list[str], list[str]]:
    """(problems, notes): circles of files in the package at `src`, known ones (listed) as notes."""
    debt = {line for line in read_debt(debt_file) if line.startswith("circle:")}
    problems: list[str] = []
    notes: list[str] = []
    seen: set[str] = set()
    found = [(part, "files") for part in circles(src)]
    found += [([f"{src.name}.{room}" for room in part], "rooms") for part in circles(src, rooms=True)]
    for part, kind in found:
        key = "circle: " + " ".join(part)
        seen.add(key)
        if key in debt:
            notes.append(f"layers: known debt {key}")
        else:
            problems.append(f"layers: {kind} import each other in a circle: {' '.join(part)}")
    for stale in sorted(line for line in debt - seen if line.split()[1].split(".")[0] == src.name):
        problems.append(f"layers: {stale} is listed in {debt_file} but is no circle any more; remove the line")
    return problems, notes


def check_layers(src: Path, debt_file: Path | None) -> tuple[list[str], list[str]]:
    """(problems, notes) for the package at `src` (the `ds_engine` directory)."""
    package = src.name
    debt = {line for line in read_debt(debt_file) if not line.startswith("circle:")}
    problems: list[str] = []
    notes: list[str] = []
    seen: set[str] = set()
    for path in sorted(src.rglob("*.py")):
        for edge in imports_of(path, src.parent, package):
            why = wrong_way(edge)
            if why is None:
                continue
            seen.add(edge.key)
            if edge.key in debt:
                notes.append(f"layers: known debt {edge.key} at {edge.where}")
            else:
                problems.append(f"layers: {edge.importer} {why} at {edge.where}")
    for stale in sorted(debt - seen):
        problems.append(f"layers: {stale} is listed in {debt_file} but no longer imported; remove the line")
    return problems, notes
