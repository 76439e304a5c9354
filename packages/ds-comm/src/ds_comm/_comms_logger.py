"""Comms logger: per-op count, bytes, latency, algorithmic and bus bandwidth of collectives."""

from __future__ import annotations

import dataclasses
import inspect
import logging
from collections import defaultdict
from typing import TYPE_CHECKING

from ds_comm._comms_logger_queries import CommsLoggerQueries

if TYPE_CHECKING:
    from ds_comm.config import CommsLoggerConfig

logger = logging.getLogger(__name__)

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
            logger.info("comm op: %s | time (ms): %.3f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                        name, latency_s * 1e3, format_bytes(size_bytes), algbw * 8 / 1e9, busbw * 8 / 1e9)

    def reset(self) -> None:
        self.records.clear()

    def summary(self) -> str:
        """A table: op, message size, count, total bytes, avg latency, avg algbw and busbw."""
        header = f"{'Comm. Op':<28}{'Message Size':>14}{'Count':>8}{'Total Bytes':>14}" \
                 f"{'Avg Lat(ms)':>13}{'algbw(Gbps)':>13}{'busbw(Gbps)':>13}"
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


def format_bytes(size: int) -> str:
    """`1536` -> `1.5 KB` (powers of 1024)."""
    value = float(size)
    for unit in ("B", "KB", "MB", "GB"):
        if value < 1024 or unit == "GB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} GB"


comms_logger = CommsLogger()
