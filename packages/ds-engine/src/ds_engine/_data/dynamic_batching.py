"""Dynamic batching for an engine: `get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed`.

Reads `data_efficiency.data_sampling.dynamic_batching` from the engine's config and the length of every
sample from, in order: `dataset_seqlens` if given; else the data analyzer's `seqlen` metric under
`metrics_path` (`seqlen/seqlen_sample_to_metric`); else it runs `DistributedDataAnalyzer` with
`batch_seqlens_fn` to write that metric first. The batch of the lr scaling is the engine's
`train_batch_size`, the loader's items are `train_micro_batch_size_per_gpu` micro batches each, split
over the data-parallel ranks; a pipeline engine gets equally sized micro batches padded to one length.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import torch.distributed as tdist
from torch.utils.data import DataLoader

from ds_engine._data.distributed_analyzer import DistributedDataAnalyzer
from ds_engine._data.indexed_dataset import MMapIndexedDataset
from ds_engine._data.variable_batch import VariableBatchSizeLR, get_dataloader_and_lr_scheduler_for_variable_batch_size

logger = logging.getLogger(__name__)

__all__ = ["get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed"]

_KEY = "data_efficiency.data_sampling.dynamic_batching"


def _seqlens_from_metrics(
    dataset: Any, engine: Any, metrics_path: str | None, collate_fn: Any, batch_seqlens_fn: Any
) -> np.ndarray:
    if not metrics_path:
        raise ValueError(f"{_KEY}.metrics_path is required when dataset_seqlens is not given")
    prefix = os.path.join(metrics_path, "seqlen/seqlen_sample_to_metric")
    if not (os.path.exists(f"{prefix}.bin") and os.path.exists(f"{prefix}.idx")):
        if batch_seqlens_fn is None:
            raise ValueError(
                f"no sequence-length metric at {prefix}.bin/.idx: pass dataset_seqlens, or batch_seqlens_fn to "
                "compute it with the data analyzer"
            )
        logger.warning("no sequence-length metric at %s; computing it with the data analyzer", prefix)
        DistributedDataAnalyzer(
            dataset=dataset,
            metric_functions=[batch_seqlens_fn],
            collate_fn=collate_fn,
            batch_size=2**10,
            num_workers=engine.world_size,
            worker_id=engine.global_rank,
            save_path=metrics_path,
            metric_types=["single_value_per_sample"],
            metric_names=["seqlen"],
        ).run_map_reduce()
    seqlens = MMapIndexedDataset(prefix, skip_warmup=True)
    if len(seqlens) != len(dataset):
        raise ValueError(
            f"{prefix} holds {len(seqlens)} lengths for a dataset of {len(dataset)}; the dataset changed? delete "
            f"{metrics_path} to recompute them"
        )
    return np.concatenate(list(seqlens)).astype(np.int64) if len(seqlens) else np.zeros(0, dtype=np.int64)


def get_dataloader_and_lr_scheduler_for_variable_batch_size_deepspeed(
    dataset: Any,
    engine: Any,
    dataset_seqlens: Sequence[int] | None = None,
    dataset_filter_ids: Sequence[int] | None = None,
    dataloader_collate_fn: Callable[[list[Any]], Any] | None = None,
    sample_padding_fn: Callable[[Any, int], Any] | None = None,
    batch_seqlens_fn: Callable[[Any], Any] | None = None,
) -> tuple[DataLoader[Any], VariableBatchSizeLR, dict[str, Any]]:
    """`(dataloader, lr_scheduler, deepspeed_io_kwargs)` for `dataset` under the engine's dynamic batching
    settings (see the module docstring).

    Raises:
        ValueError: dynamic batching is not enabled in the config, or no sequence lengths can be found.
    """
    config = engine.data_efficiency_config()
    sampling = config["data_sampling"]
    batching = sampling["dynamic_batching"]
    if not batching["enabled"]:
        raise ValueError(f"{_KEY}.enabled is false; enable it (with max_tokens) to use dynamic batching")
    if dataset_seqlens is None:
        # a 1-D int64 array: sized, indexable and iterable like the Sequence[int] the batching reads
        dataset_seqlens = cast(
            Sequence[int],
            _seqlens_from_metrics(
                dataset, engine, batching.get("metrics_path"), dataloader_collate_fn, batch_seqlens_fn
            ),
        )
    group = engine.data_parallel_group
    distributed = group is not None and tdist.is_initialized()
    pipeline = bool(getattr(engine, "pipeline_parallelism", False))
    return get_dataloader_and_lr_scheduler_for_variable_batch_size(
        dataset=dataset,
        dataset_filter_ids=dataset_filter_ids,
        dataset_seqlens=dataset_seqlens,
        effective_batch_size=engine.train_batch_size(),
        max_tokens=batching["max_tokens"],
        lr_scaling_method=batching["lr_scaling_method"],
        sequence_picking_order=batching["sequence_picking_order"],
        min_batch_size=batching["min_batch_size"],
        max_batch_size=batching["max_batch_size"],
        dataloader_batch_size=engine.train_micro_batch_size_per_gpu(),
        dataloader_rank=tdist.get_rank(group) if distributed else 0,
        dataloader_num_replicas=tdist.get_world_size(group) if distributed else 1,
        dataloader_num_workers=sampling["num_workers"],
        dataloader_collate_fn=dataloader_collate_fn,
        dataloader_pin_memory=sampling["pin_memory"],
        sample_padding_fn=sample_padding_fn,
        lr_scheduler_or_optimizer=engine.lr_scheduler or engine.optimizer,
        required_microbatches_of_same_size=pipeline,
        required_microbatches_of_same_seqlen=pipeline,
        verbose=batching["verbose"],
        seed=config["seed"],
    )
