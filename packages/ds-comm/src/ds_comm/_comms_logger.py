"""Comms logger: per-op count, bytes, latency, algorithmic and bus bandwidth of collectives; `configure` sets it up.

It imports neither the collectives nor `_dist_init`, so both can import `configure` and the
logger from here at module level (they used to import each other).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from ds_comm._byte_units import format_bytes
from ds_comm._comms_logger_queries import CommsLoggerQueries

if TYPE_CHECKING:
    from ds_comm.config import CommsLoggerConfig

logger = logging.getLogger(__name__)

__all__ = ["CommsLogger", "comms_logger", "configure"]

# Bus-bandwidth correction factors as nccl-tests defines them: the fraction of the payload each
# rank must move over its link, so busbw is comparable across world sizes and ops.
_BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "all_gather_into_tensor": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "reduce_scatter_tensor": lambda n: (n - 1) / n,
    "all_to_all_single": lambda n: (n - 1) / n,
}


def bus_factor(op: str, world_size: int) -> float:
    """nccl-tests bus-bandwidth factor for `op` on `world_size` ranks (1 for p2p, broadcast, reduce)."""
    if world_size <= 1:
        return 1.0
    return _BUS_FACTOR.get(op, lambda n: 1.0)(world_size)


@dataclasses.dataclass
class OpRecord:
    """Totals for one (op, message size) pair."""

    count: int = 0
    total_bytes: int = 0
    total_latency_s: float = 0.0
    busbw_sum: float = 0.0
    algbw_sum: float = 0.0


class CommsLogger(CommsLoggerQueries):
    """Collects records when enabled; `enabled` is checked once per collective and is cheap when off."""

    def __init__(self) -> None:
        self.config: CommsLoggerConfig | None = None  # set by configure(); records need it
        self.enabled = False
        self.records: dict[str, dict[int, OpRecord]] = defaultdict(lambda: defaultdict(OpRecord))

    def configure(self, config: CommsLoggerConfig) -> None:
        self.config = config
        self.enabled = config.enabled

    def should_record(self, op: str) -> bool:
        return self.enabled and self.config is not None and (self.config.prof_all or op in self.config.prof_ops)

    def record(self, op: str, size_bytes: int, latency_s: float, world_size: int) -> None:
        name = op
        if self.config.debug:
            caller = _caller_name()
            name = f"{op} | [Caller Func: {caller}]"
        latency_s = max(latency_s, 1e-9)
        algbw = size_bytes / latency_s
        busbw = algbw * bus_factor(op, world_size)
        rec = self.records[name][size_bytes]
        rec.count += 1
        rec.total_bytes += size_bytes
        rec.total_latency_s += latency_s
        rec.algbw_sum += algbw
        rec.busbw_sum += busbw
        if self.config.verbose:
            logger.info(
                "comm op: %s | time (ms): %.3f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                name,
                latency_s * 1e3,
                format_bytes(size_bytes),
                algbw * 8 / 1e9,
                busbw * 8 / 1e9,
            )

    def reset(self) -> None:
        self.records.clear()

    def summary(self) -> str:
        """A table: op, message size, count, total bytes, avg latency, avg algbw and busbw."""
        header = (
            f"{'Comm. Op':<28}{'Message Size':>14}{'Count':>8}{'Total Bytes':>14}"
            f"{'Avg Lat(ms)':>13}{'algbw(Gbps)':>13}{'busbw(Gbps)':>13}"
        )
        lines = [header]
        for op in sorted(self.records):
            for size in sorted(self.records[op]):
                rec = self.records[op][size]
                lines.append(
                    f"{op:<28}{format_bytes(size):>14}{rec.count:>8}{format_bytes(rec.total_bytes):>14}"
                    f"{rec.total_latency_s / rec.count * 1e3:>13.3f}{rec.algbw_sum / rec.count * 8 / 1e9:>13.3f}"
                    f"{rec.busbw_sum / rec.count * 8 / 1e9:>13.3f}"
                )
        return "\n".join(lines)


def _caller_name() -> str:
    frame = inspect.currentframe()
    # Skip this module and ds_comm.collectives frames to reach the user's call site.
    while frame is not None and frame.f_globals.get("__name__", "").startswith("ds_comm."):
        frame = frame.f_back
    return frame.f_code.co_name if frame is not None else "?"


comms_logger = CommsLogger()


def configure(
    config: CommsLoggerConfig | dict[str, Any] | Any | None = None,
    *,
    enabled: bool | None = None,
    prof_all: bool | None = None,
    prof_ops: list[str] | None = None,
    verbose: bool | None = None,
    debug: bool | None = None,
) -> None:
    """Set up the comms logger from a `comms_logger` section (model or dict) and/or keyword overrides.

    An object with a `comms_logger` attribute (an engine config) is accepted too.
    """
    # pydantic (~0.3 s) loads only when a script configures the logger, not when ds_comm is imported.
    from ds_comm.config import CommsLoggerConfig, validate_section

    if config is not None and not isinstance(config, (CommsLoggerConfig, dict)):
        config = getattr(config, "comms_logger", None)
    base = validate_section(CommsLoggerConfig, config or {}, path="comms_logger")
    overrides = {
        k: v
        for k, v in dict(enabled=enabled, prof_all=prof_all, prof_ops=prof_ops, verbose=verbose, debug=debug).items()
        if v is not None
    }
    comms_logger.configure(base.model_copy(update=overrides) if overrides else base)
