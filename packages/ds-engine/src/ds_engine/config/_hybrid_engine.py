"""The `hybrid_engine` section (DeepSpeed's `HybridEngineConfig`): one engine that trains and generates (RLHF).

`enabled` makes initialize() build a `DeepSpeedHybridEngine`. DeepSpeed's hybrid engine swaps the
model's layers for its CUDA inference kernels; ds runs the model's own forward instead, so the keys
that size or shard those kernels have nothing to act on: `max_out_tokens` (the kernels' workspace) and
`tp_gather_partition_size` (only read with `inference_tp_size` > 1) are accepted at any value with a
warning, and tensor-parallel generation (`inference_tp_size` > 1) and CUDA-graph capture of the
kernels are refused.
"""

from __future__ import annotations

from typing import ClassVar

from ds_comm import ConfigModel
from ds_engine.config._types import PosInt

__all__ = ["HybridEngineConfig"]


class HybridEngineConfig(ConfigModel):
    """`hybrid_engine`: train with ZeRO, generate with every parameter gathered once per `generate()` call."""

    inert_keys: ClassVar[dict[str, str]] = {
        "inference_tp_size": "tensor-parallel generation in the hybrid engine is not implemented; generation "
        "runs data-parallel, each rank on its own prompts",
        "enable_cuda_graph": "CUDA-graph capture of DeepSpeed's inference kernels is not implemented (ds "
        "generates with the model's own forward)",
    }
    ignored_keys: ClassVar[dict[str, str]] = {
        "max_out_tokens": "it sizes DeepSpeed's inference-kernel workspace; ds generates with the model's own "
        "forward, whose key/value cache grows as needed",
        "tp_gather_partition_size": "it is read only with inference_tp_size > 1, which ds does not implement",
    }

    enabled: bool = False
    """Build the hybrid engine (`engine.generate`, LoRA fusion for generation)."""
    max_out_tokens: PosInt = 512
    """DeepSpeed's inference workspace size in tokens; no effect in ds."""
    inference_tp_size: PosInt = 1
    """Tensor-parallel degree of generation; only 1 is accepted."""
    release_inference_cache: bool = False
    """After each generate(), collect garbage and return the accelerator's cached memory to the device."""
    pin_parameters: bool = True
    """ZeRO-3: gather every parameter once for the whole generate() call (False: per layer, per token)."""
    tp_gather_partition_size: PosInt = 8
    """Layers gathered at a time for tensor-parallel generation; no effect in ds."""
    enable_cuda_graph: bool = False
    """CUDA graphs for the decode steps; only false is accepted."""
