"""The printed profile: a summary, the top modules per depth, and the module tree with per-module numbers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ds_engine._report.flops_profiler.units import (
    duration_to_string,
    flops_to_string,
    macs_to_string,
    number_to_string,
    params_to_string,
)

__all__ = ["Totals", "aggregated_lines", "detailed_lines"]

Getter = Callable[[torch.nn.Module], float]


@dataclass
class Totals:
    params: float
    macs: float
    duration: float


def _pct(part: float, whole: float) -> str:
    return f"{round(100 * part / whole, 2) if whole else 0:g}%"


def aggregated_lines(
    model: torch.nn.Module, *, params: Getter, macs: Getter, duration: Getter, module_depth: int, top_modules: int
) -> list[str]:
    """Per depth, the `top_modules` module classes with the most params, MACs and forward latency."""
    by_depth: dict[int, dict[str, list[float]]] = {}

    def walk(module: torch.nn.Module, depth: int) -> None:
        row = by_depth.setdefault(depth, {}).setdefault(type(module).__name__, [0.0, 0.0, 0.0])
        row[0] += macs(module)
        row[1] += params(module)
        row[2] += duration(module)
        for child in module.children():
            walk(child, depth + 1)

    walk(model, 0)
    depth = len(by_depth) - 1 if module_depth == -1 else min(module_depth, len(by_depth))
    lines = [f"Top {top_modules} module classes by params, MACs and forward latency, per model depth:"]
    for d in range(depth):
        rows = by_depth[d]

        def top(col: int, fmt: Callable[[float], str], rows: dict[str, list[float]] = rows) -> dict[str, str]:
            ranked = sorted(rows.items(), key=lambda item: item[1][col], reverse=True)[:top_modules]
            return {name: fmt(values[col]) for name, values in ranked}

        lines += [
            f"depth {d}:",
            f"    params      - {top(1, params_to_string)}",
            f"    MACs        - {top(0, macs_to_string)}",
            f"    fwd latency - {top(2, duration_to_string)}",
        ]
    return lines


def detailed_lines(
    model: torch.nn.Module,
    totals: Totals,
    *,
    params: Getter,
    macs: Getter,
    flops: Getter,
    duration: Getter,
    module_depth: int,
) -> list[str]:
    """One line per module down to `module_depth` (-1: all), indented by depth, children after parents."""
    lines: list[str] = []

    def walk(name: str, module: torch.nn.Module, depth: int) -> None:
        if module_depth != -1 and depth > module_depth:
            return
        p, m, f, t = params(module), macs(module), flops(module), duration(module)
        rate = flops_to_string(round(f / t, 2) if t else 0)
        extra = module.extra_repr()
        label = f"({name}): " if name else ""
        lines.append(
            f"{'  ' * depth}{label}{type(module).__name__}("
            f"{params_to_string(p)} = {_pct(p, totals.params)} params, "
            f"{macs_to_string(m)} = {_pct(m, totals.macs)} MACs, "
            f"{duration_to_string(t)} = {_pct(t, totals.duration)} latency, {rate}"
            f"{', ' + extra if extra else ''})"
        )
        for child_name, child in module.named_children():
            walk(child_name, child, depth + 1)

    walk("", model, 0)
    return lines


def summary_value(label: str, value: object) -> str:
    return f"{label:<62} {value}"


def number(value: float) -> str:
    return number_to_string(value)
