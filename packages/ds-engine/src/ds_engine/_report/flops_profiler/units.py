"""Human-readable numbers for the profile: `1.23 M`, `4.5 GMACs`, `12 ms` (DeepSpeed's helper names)."""

from __future__ import annotations

__all__ = [
    "DEFAULT_PRECISION",
    "bytes_to_string",
    "duration_to_string",
    "flops_to_string",
    "macs_to_string",
    "number_to_string",
    "params_to_string",
]

DEFAULT_PRECISION = 2
_SCALES = {"T": 1e12, "G": 1e9, "M": 1e6, "K": 1e3, "": 1.0, "m": 1e-3, "u": 1e-6}


def _auto_unit(num: float) -> str:
    for unit in ("T", "G", "M", "K"):
        if num >= _SCALES[unit]:
            return unit
    if num >= 1 or num == 0:
        return ""
    return "m" if num >= 1e-3 else "u"


def number_to_string(num: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """`num` scaled to a unit prefix (T, G, M, K, m, u; chosen from its size when `units` is None)."""
    unit = _auto_unit(num) if units is None else units
    return f"{round(num / _SCALES.get(unit, 1.0), precision):g} {unit}"


def macs_to_string(macs: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(macs, units, precision)}MACs"


def flops_to_string(flops: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """A rate: floating-point operations per second."""
    return f"{number_to_string(flops, units, precision)}FLOPS"


def bytes_to_string(b: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(b, units, precision)}B"


def params_to_string(params: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    """Parameter counts use B (billions) where the other helpers use G."""
    unit = units.replace("B", "G") if units else units
    return number_to_string(params, unit, precision).replace("G", "B").strip()


def duration_to_string(seconds: float, units: str | None = None, precision: int = DEFAULT_PRECISION) -> str:
    return f"{number_to_string(seconds, units, precision)}s"
