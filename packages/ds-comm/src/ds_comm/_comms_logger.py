"""Comms logger: per-op count, bytes, latency, algorithmic and bus bandwidth of collectives; `configure` sets it up.

It imports neither the collectives nor `_dist_init`, so both can import `configure` and the
logger from here at module level (they used to import each other).
"""

from __future__ import annotations

import inspect
import logging
from typing import TYPE_CHECKING, Any

from ds_comm._byte_units import format_bytes
from ds_comm._comms_logger_queries import CommsLoggerQueries

if TYPE_CHECKING:
    from ds_comm.config import CommsLoggerConfig

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_SAMPLES", "CommsLogger", "comms_logger", "configure"]

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


DEFAULT_MAX_SAMPLES = 1000
"""Per (op, message size), how many of the most recent calls keep their latency and bandwidths
(`CommsLogger(max_samples=...)`): a long run's record stays bounded (about 100 KB per pair at most),
while the call count and the total latency stay exact."""


class CommsLogger(CommsLoggerQueries):
    """Collects records when enabled; `enabled` is checked once per collective and is cheap when off.

    [Note: the record layout] As DeepSpeed keeps it: `comms_dict[op_name][msg_size_bytes]` is
    `[count, [latency_ms, ...], [algbw_gbps, ...], [busbw_gbps, ...]]`, three parallel lists whose index
    i is the i-th kept call. `count` counts every call; the lists keep the most recent `max_samples`
    calls (older ones are dropped together from the front, so the lists stay parallel), and the latency
    of dropped calls is kept summed so totals stay exact. Summaries read the lists and never reorder them.

    Args:
        max_samples: calls kept per (op, message size) in the lists (default `DEFAULT_MAX_SAMPLES`).

    Raises:
        ValueError: `max_samples` < 1.
    """

    def __init__(self, max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        if max_samples < 1:
            raise ValueError(f"CommsLogger: max_samples must be >= 1, got {max_samples}")
        self.config: CommsLoggerConfig | None = None  # set by configure(); records need it
        self.enabled = False
        self.max_samples = int(max_samples)
        self._comms_dict: dict[str, dict[int, list[Any]]] = {}
        self._dropped_latency_ms: dict[tuple[str, int], float] = {}

    @property
    def comms_dict(self) -> dict[str, dict[int, list[Any]]]:
        """The records, `{op_name: {msg_size: [count, [latency_ms], [algbw_gbps], [busbw_gbps]]}}`.

        Assigning a new dict replaces the records (and forgets the latency of calls dropped earlier).
        """
        return self._comms_dict

    @comms_dict.setter
    def comms_dict(self, value: dict[str, dict[int, list[Any]]]) -> None:
        self._comms_dict = value
        self._dropped_latency_ms = {}

    def configure(self, config: CommsLoggerConfig) -> None:
        self.config = config
        self.enabled = config.enabled

    def should_record(self, op: str) -> bool:
        return self.enabled and self.config is not None and (self.config.prof_all or op in self.config.prof_ops)

    def record(self, op: str, size_bytes: int, latency_s: float, world_size: int, bus_op: str | None = None) -> None:
        """Record one call of `op`; `bus_op` (default `op`) names the collective whose bus-bandwidth factor
        applies, for a record kept under a custom name (`timed_op`'s `log_name`)."""
        name = op
        if self.config is not None and self.config.debug:
            caller = _caller_name()
            name = f"{op} | [Caller Func: {caller}]"
        latency_s = max(latency_s, 1e-9)
        algbw_gbps = size_bytes / latency_s * 8 / 1e9
        busbw_gbps = algbw_gbps * bus_factor(bus_op or op, world_size)
        self._append(name, size_bytes, latency_s * 1e3, algbw_gbps, busbw_gbps)
        if self.config is not None and self.config.verbose:
            logger.info(
                "comm op: %s | time (ms): %.3f | msg size: %s | algbw (Gbps): %.2f | busbw (Gbps): %.2f",
                name,
                latency_s * 1e3,
                format_bytes(size_bytes),
                algbw_gbps,
                busbw_gbps,
            )

    def _append(self, name: str, size_bytes: int, latency_ms: float, algbw_gbps: float, busbw_gbps: float) -> None:
        sizes = self._comms_dict.setdefault(name, {})
        entry = sizes.get(size_bytes)
        if entry is None:
            sizes[size_bytes] = [1, [latency_ms], [algbw_gbps], [busbw_gbps]]
            return
        entry[0] += 1
        entry[1].append(latency_ms)
        entry[2].append(algbw_gbps)
        entry[3].append(busbw_gbps)
        excess = len(entry[1]) - self.max_samples
        if excess > 0:
            key = (name, size_bytes)
            self._dropped_latency_ms[key] = self._dropped_latency_ms.get(key, 0.0) + sum(entry[1][:excess])
            for values in entry[1:]:
                del values[:excess]


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
