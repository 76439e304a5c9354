"""What `zero_optimization.zenflow` does, as `explain` lines: the resolved selection and update schedule.

The choices (how many columns, when they are reselected, how often and where the CPU update runs, what
divides each loss) are ds-zero's `ZenFlowSchedule`; the plan states them before anything is built.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ds_engine._optional import require

if TYPE_CHECKING:
    from ds_engine.config import DeepSpeedConfig

logger = logging.getLogger(__name__)

__all__ = ["zenflow_lines"]


def zenflow_lines(config: DeepSpeedConfig) -> tuple[str, ...]:
    """The ZenFlow lines of the wrapper chain; () without a `zenflow` section (checked at config time)."""
    zenflow = getattr(config.zero.zero_config, "zenflow", None)
    if zenflow is None:
        return ()
    s = require("ds_zero", extra="zero", feature="zero_optimization.zenflow").ZenFlowSchedule.from_config(zenflow)
    when = (
        f"every {s.select_interval} micro steps"
        if s.select_interval
        else "once, after warm-up (epoch length unknown before the data loader)"
    )
    cpu = (
        "in a worker process, overlapped with the next window (applied one window late)"
        if s.overlap_step
        else "in step(), blocking"
    )
    per = (
        "per weight, among the columns whole inside one of DeepSpeed's transposed ZeRO-3 partitions"
        if config.zero.stage == 3
        else "per partition"
    )
    return (
        f"ZenFlow: top {s.topk_ratio:g} of each weight's columns (by |gradient| per column, chosen {per}) "
        f"updated every micro step by ZenFlowSelectiveAdamW" + (" (moments on the host)" if zenflow.offload else ""),
        f"  selection ({s.select_strategy}): {when}; warm-up: {s.full_warm_up_rounds} full update step(s)",
        (
            f"  the other gradients accumulate on the host; the CPU optimizer applies them every "
            f"{s.update_interval} micro steps, {cpu}"
            if not s.auto_update
            else "  the other gradients accumulate on the host; the CPU optimizer applies their mean when "
            f'update_interval "auto" decides (at least int({s.auto_ratio:g} x the weights) have left-out '
            f"gradients caught up with the selected ones; also before each reselection), {cpu}"
        ),
        (
            f"  each loss is divided by update_interval={s.update_interval} (gradient_accumulation_steps); "
            "the lr schedule steps every micro step"
            if not s.auto_update
            else "  no loss is divided (the window's length is decided as it goes); the lr schedule steps "
            "every micro step"
        ),
    )
