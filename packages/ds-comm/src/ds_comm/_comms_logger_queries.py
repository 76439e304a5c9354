"""The comms logger's profiling switches and read-outs, under DeepSpeed's `CommsLogger` method names.

DeepSpeed keeps every call's latency and reports a 10%-trimmed mean; ds keeps running sums per
(op, message size), so the averages here are plain means over all recorded calls.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ds_comm._byte_units import format_bytes

if TYPE_CHECKING:
    from ds_comm._comms_logger import OpRecord
    from ds_comm.config import CommsLoggerConfig


class CommsLoggerQueries:
    """Mixed into `CommsLogger`: turn profiling on and off at run time, and read the records back."""

    config: CommsLoggerConfig | None
    records: dict[str, dict[int, OpRecord]]

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
        return any(self.records.values())

    def reset_data(self) -> None:
        """Forget every record."""
        self.records.clear()

    def get_operation_names(self) -> list[str]:
        """The recorded op names (with the caller appended when `debug` is on), in first-seen order."""
        return [name for name, sizes in self.records.items() if sizes]

    def get_total_operations(self) -> int:
        """Number of recorded calls over all ops and sizes."""
        return sum(rec.count for sizes in self.records.values() for rec in sizes.values())

    def get_operation_summary(self, operation_name: str) -> dict[int, dict[str, Any]] | None:
        """Per message size: count, total/avg latency (ms), avg algbw/busbw (Gbps), size; None if never seen.

        The keys are DeepSpeed's: `count, total_latency_ms, avg_latency_ms, tput_avg_gbps, busbw_avg_gbps,
        msg_size_bytes, msg_size_str`.
        """

        sizes = self.records.get(operation_name)
        if not sizes:
            return None
        return {
            size: {
                "count": rec.count,
                "total_latency_ms": rec.total_latency_s * 1e3,
                "avg_latency_ms": rec.total_latency_s / rec.count * 1e3,
                "tput_avg_gbps": rec.algbw_sum / rec.count * 8 / 1e9,
                "busbw_avg_gbps": rec.busbw_sum / rec.count * 8 / 1e9,
                "msg_size_bytes": size,
                "msg_size_str": format_bytes(size),
            }
            for size, rec in sorted(sizes.items())
        }
