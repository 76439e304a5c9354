"""The comms logger's profiling switches and read-outs, under DeepSpeed's `CommsLogger` method names.

The read-outs see the records in DeepSpeed's layout (`CommsLogger`'s note) and summarise them as DeepSpeed
does (`ds_comm._comms_summary`: 10%-trimmed means over the kept calls, exact counts and totals).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from ds_comm._comms_summary import format_summary, metadata, size_summary, straggler_analysis, summarize

if TYPE_CHECKING:
    from ds_comm.config import CommsLoggerConfig

logger = logging.getLogger(__name__)


class CommsLoggerQueries:
    """Mixed into `CommsLogger`: turn profiling on and off at run time, and read the records back."""

    config: CommsLoggerConfig | None
    comms_dict: dict[str, dict[int, list[Any]]]
    _dropped_latency_ms: dict[tuple[str, int], float]

    def _update_config(self, **changes: Any) -> None:
        from ds_comm.config import CommsLoggerConfig  # pydantic loads only when profiling is switched

        base = self.config if self.config is not None else CommsLoggerConfig()
        self.config = base.model_copy(update=changes)

    def _setting(self, name: str) -> Any:
        from ds_comm.config import CommsLoggerConfig  # pydantic loads only when a setting is read

        return getattr(self.config if self.config is not None else CommsLoggerConfig(), name)

    # DeepSpeed's CommsLogger keeps its settings as attributes; here they are read from the config.
    @property
    def prof_all(self) -> bool:
        """Whether every op is recorded (else only `prof_ops`)."""
        return bool(self._setting("prof_all"))

    @property
    def prof_ops(self) -> list[str]:
        """The op names recorded when `prof_all` is off."""
        return list(self._setting("prof_ops"))

    @property
    def verbose(self) -> bool:
        """Whether each recorded op is logged as it completes."""
        return bool(self._setting("verbose"))

    @property
    def debug(self) -> bool:
        """Whether each record carries its calling function's name."""
        return bool(self._setting("debug"))

    def start_profiling_comms(self) -> None:
        """Record every op from now on (sets `prof_all`; the logger must be `enabled` to record)."""
        self._update_config(prof_all=True)

    def stop_profiling_comms(self) -> None:
        """Stop recording ops that are not named in `prof_ops` (clears `prof_all`)."""
        self._update_config(prof_all=False)

    def start_profiling_op(self, op_name_list: list[str]) -> None:
        """Add these op names (`"all_reduce"`, ...) to `prof_ops`."""
        current = self.config.prof_ops if self.config is not None else []
        self._update_config(prof_ops=sorted(set(current) | set(op_name_list)))

    def stop_profiling_op(self, op_name_list: list[str]) -> None:
        """Remove these op names from `prof_ops`."""
        current = self.config.prof_ops if self.config is not None else []
        self._update_config(prof_ops=[op for op in current if op not in op_name_list])

    def has_data(self) -> bool:
        """Whether any op has been recorded."""
        return any(self.comms_dict.values())

    def reset_data(self) -> None:
        """Forget every record."""
        self.comms_dict.clear()
        self._dropped_latency_ms.clear()

    def total_latency_ms(self, name: str, size_bytes: int) -> float:
        """The summed latency of every recorded call of `name` at `size_bytes`, dropped samples included."""
        entry = self.comms_dict[name][size_bytes]
        return float(sum(entry[1])) + self._dropped_latency_ms.get((name, size_bytes), 0.0)

    def get_raw_data(self) -> dict[str, dict[int, list[Any]]]:
        """A copy of the records: `{op_name: {msg_size: [count, [latency_ms], [algbw_gbps], [busbw_gbps]]}}`.

        Index i of the three lists is the same call (the most recent `max_samples` calls are kept; `count`
        counts all). The lists are copies, so the caller may sort or change them.
        """
        return {
            name: {size: [e[0], list(e[1]), list(e[2]), list(e[3])] for size, e in sizes.items()}
            for name, sizes in self.comms_dict.items()
        }

    def get_operation_names(self) -> list[str]:
        """The recorded op names (with the caller appended when `debug` is on), in first-seen order."""
        return [name for name, sizes in self.comms_dict.items() if sizes]

    def get_total_operations(self) -> int:
        """Number of recorded calls over all ops and sizes."""
        return sum(entry[0] for sizes in self.comms_dict.values() for entry in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """Per message size: count, total/avg latency (ms), avg algbw/busbw (Gbps), size; None if never seen.

        The keys are DeepSpeed's: `count, total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps,
        msg_size_bytes, msg_size_str`; the averages are 10%-trimmed means over the kept calls, `count` and
        `total_latency_ms` cover every call. The records are read, never reordered.
        """
        sizes = self.comms_dict.get(operation_name)
        if not sizes:
            return None
        return {size: size_summary(self, operation_name, size) for size in sorted(sizes)}

    def summary(self, *, straggler: bool = False) -> str:
        """DeepSpeed's summary table of every record (`straggler`: the straggler table, a collective)."""
        return format_summary(straggler_analysis(self) if straggler else summarize(self), straggler=straggler)

    def log_all(
        self, print_log: bool = True, show_straggler: bool = False, return_dict: bool = False
    ) -> dict[str, Any] | None:
        """Log the summary table (and the straggler table) of this rank's records, and/or return them.

        As DeepSpeed's `CommsLogger.log_all`, except that the tables go to the `ds_comm` logger at INFO
        (the library never prints). With `show_straggler` every rank must call it (one MIN all-reduce of
        the latencies per record over the world).

        Returns:
            With `return_dict`: `{"summary": {op: {size: entry}}, "straggler_analysis": {...} or None,
            "metadata": {"world_size", "rank", "timestamp"}}`; else None.
        """
        summary = summarize(self)
        stragglers = straggler_analysis(self) if show_straggler else None
        if print_log:
            logger.info("comms summary:\n%s", format_summary(summary))
            if stragglers is not None:
                logger.info("comms breakdown with straggler effect:\n%s", format_summary(stragglers, straggler=True))
        if not return_dict:
            return None
        return {"summary": summary, "straggler_analysis": stragglers, "metadata": metadata()}
