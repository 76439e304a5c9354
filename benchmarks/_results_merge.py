"""`results.py --only A,B` on an existing RESULTS.md: those benchmarks' parts of the page are replaced, the rest kept.

A page (`_results_md.render`) is a header (the machine and the run) and `## ` sections: Figures (one table
whose rows start with their benchmark's name), plot sections (each owned by one benchmark:
`_results_md.PLOT_OWNERS`), Runs (a table keyed the same way) and Raw output (one `<details>` block per
benchmark). A partial run renders a page of its benchmarks alone; from it this module takes their table
rows, their plot sections and their raw output, puts them where a full run would, and leaves every other
benchmark's figures as they were. The header stays that of the page's full run, with a note naming what
was re-run, when, at which commit and under which load.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from _results_md import PLOT_OWNERS

_TABLES = ("## Figures", "## Runs")
_RAW = "## Raw output"


def _sections(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """The lines before the first `## ` heading, and each section as (heading, its lines after the heading)."""
    header: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for line in text.split("\n"):
        if line.startswith("## "):
            sections.append((line, []))
        elif sections:
            sections[-1][1].append(line)
        else:
            header.append(line)
    return header, sections


def _key(row: str) -> str:
    """A table row's benchmark (its first cell)."""
    return row.split("|")[1].strip()


def _ordered(items: list[tuple[str, list[str]]], order: Sequence[str]) -> list[tuple[str, list[str]]]:
    rank = {name: i for i, name in enumerate(order)}
    return sorted(items, key=lambda item: rank.get(item[0], len(rank)))  # stable: rows keep their order


def _merge_table(old: list[str], new: list[str], names: Collection[str], order: Sequence[str]) -> list[str]:
    """`old`'s lines with the rows of `names` replaced by `new`'s; rows sorted into benchmark order."""

    def split(lines: list[str]) -> tuple[list[str], list[str], list[str]]:
        start = next((i for i, line in enumerate(lines) if line.startswith("| ---")), None)
        if start is None:
            return lines, [], []
        end = start + 1
        while end < len(lines) and lines[end].startswith("|"):
            end += 1
        return lines[: start + 1], lines[start + 1 : end], lines[end:]

    before, old_rows, after = split(old)
    _, new_rows, _ = split(new)
    kept = [(_key(r), [r]) for r in old_rows if _key(r) not in names]
    rows = _ordered(kept + [(_key(r), [r]) for r in new_rows], order)
    return before + [r for _, (r,) in rows] + after


def _details(lines: list[str]) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Raw output: the lines before the first block, and each `<details>` block by its benchmark."""
    intro: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    for line in lines:
        if line.startswith("<details><summary>"):
            blocks.append((line.removeprefix("<details><summary>").split("<", 1)[0], [line]))
        elif blocks:
            blocks[-1][1].append(line)
        else:
            intro.append(line)
    return intro, blocks


def _merge_raw(old: list[str], new: list[str], names: Collection[str], order: Sequence[str]) -> list[str]:
    intro, old_blocks = _details(old)
    _, new_blocks = _details(new)
    blocks = _ordered([b for b in old_blocks if b[0] not in names] + new_blocks, order)
    return intro + [line for _, block in blocks for line in block]


def _owner(heading: str) -> str | None:
    return PLOT_OWNERS.get(heading)


def merge_pages(old: str, new: str, names: Collection[str], order: Sequence[str], note: str) -> str:
    """`old` (a whole RESULTS.md) with the parts of the benchmarks `names` taken from `new` (a page of them alone).

    Args:
        order: every benchmark in page order (`results.discover()`): where merged rows and blocks go.
        note: one line saying what was re-run; it is quoted under the page's title.
    """
    header, old_sections = _sections(old)
    _, new_sections = _sections(new)
    fresh = dict(new_sections)
    out: list[tuple[str, list[str]]] = []
    for heading, lines in old_sections:
        if heading in _TABLES:
            out.append((heading, _merge_table(lines, fresh.get(heading, []), names, order)))
        elif heading == _RAW:
            out.append((heading, _merge_raw(lines, fresh.get(heading, []), names, order)))
        elif _owner(heading) in names:
            if heading in fresh:
                out.append((heading, fresh[heading]))
        else:
            out.append((heading, lines))
    have = {heading for heading, _ in out}
    # A section the old page lacks goes where render() puts it: Figures, plot sections, Runs, Raw output.
    for heading, lines in new_sections:
        if heading in have or not (heading in (*_TABLES, _RAW) or _owner(heading) in names):
            continue
        if heading == "## Figures":
            at = 0
        else:
            later = (_RAW,) if heading == "## Runs" else () if heading == _RAW else ("## Runs", _RAW)
            at = next((i for i, (h, _) in enumerate(out) if h in later), len(out))
        out.insert(at, (heading, lines))
    title, rest = header[:1], header[1:]
    header = [*title, "", f"> {note}", *rest] if title else [f"> {note}", *rest]
    return "\n".join(header + [line for heading, lines in out for line in (heading, *lines)])
