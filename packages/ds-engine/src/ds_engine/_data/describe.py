"""What the data-sampling settings make the engine do, in words (for `explain`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["describe_data_sampling"]


def _schedule(metric: Mapping[str, Any]) -> str:
    stype = metric["schedule_type"]
    low, high = metric["min_difficulty"], metric["max_difficulty"]
    sconf = metric.get("schedule_config") or {}
    if stype == "fixed_discrete":
        return f"fixed_discrete difficulties {sconf['difficulty']} until steps {sconf['max_step']}"
    if stype == "custom":
        return f"custom ({low} -> {high}; set with engine.set_custom_curriculum_learning_schedule)"
    root = f", root degree {sconf['root_degree']}" if stype == "fixed_root" else ""
    return (
        f"{stype} {low} -> {high} over {sconf['total_curriculum_step']} steps, in multiples of "
        f"{sconf['difficulty_step']}{root}"
    )


def describe_data_sampling(data_efficiency: Mapping[str, Any]) -> list[str]:
    """Lines on curriculum learning and dynamic batching (none when both are off)."""
    sampling = data_efficiency["data_sampling"]
    cl, db = sampling["curriculum_learning"], sampling["dynamic_batching"]
    out: list[str] = []
    if cl["enabled"]:
        out.append(
            f"training loader: curriculum sampling (DeepSpeedDataSampler, seed {data_efficiency['seed']}, "
            f"{sampling['num_epochs']} epochs, {sampling['num_workers']} loader workers); data-parallel rank 0 "
            f"draws each global batch and writes clusters under {cl['data_cluster_path']}"
        )
        for name, metric in cl["curriculum_metrics"].items():
            single = metric.get("clustering_type") == "single_cluster"
            source = "no index (single_cluster)" if single else f"index {metric.get('index_to_sample_path')}"
            out.append(f"  metric {name}: {metric['difficulty_type']}-based, {_schedule(metric)}; {source}")
    if db["enabled"]:
        limits = f"min {db['min_batch_size']}" + (f", max {db['max_batch_size']}" if db["max_batch_size"] else "")
        out.append(
            f"dynamic batching: micro batches of at most {db['max_tokens']} tokens ({limits} sequences, picked in "
            f"{db['sequence_picking_order']} order), lr scaled {db['lr_scaling_method']} by each batch's sequence "
            "count over train_batch_size; built by get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"
            "(dataset, engine), the engine's own loader is unchanged"
        )
    return out
