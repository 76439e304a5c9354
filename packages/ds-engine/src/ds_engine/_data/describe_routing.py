"""What the `data_efficiency` section makes the engine do, in words (for `explain`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds_engine.config._feature_sections import DataEfficiencyConfig

__all__ = ["data_efficiency_lines"]


def data_efficiency_lines(section: DataEfficiencyConfig, *, train_batch_size: int | None) -> list[str]:
    """One line per decision: random-LTD's layers and kept-length schedule, or that it is off."""
    ltd = section.data_routing.random_ltd
    if not ltd.enabled:
        return ["random-LTD: off (data_efficiency.data_routing.random_ltd.enabled is false)"]
    schedule = ltd.random_ltd_schedule
    assert schedule is not None and ltd.random_ltd_layer_id is not None  # checked by the section when enabled
    steps = schedule.schedule_config
    mask = f"mask keyword {ltd.model_mask_name!r}" if ltd.model_mask_name else "no mask keyword"
    return [
        f"random-LTD: layers {sorted(ltd.random_ltd_layer_id)} of {ltd.total_layer_num} run on a random subset of "
        f"tokens ({ltd.model_type}, {ltd.hidden_state_order}, {mask})",
        f"  kept tokens: {schedule.min_value} -> {schedule.max_value} over {steps.require_steps} steps "
        f"({schedule.schedule_type}, multiples of {steps.seq_per_step}); stepped at each training forward, "
        "saved in checkpoints under 'random_ltd'",
        f"  layer-tokens counted with global_batch_size={train_batch_size if train_batch_size is not None else '?'}",
        "  wrap the layers after initialize(): convert_to_random_ltd(engine, LayerClass)",
    ]
