"""`InferenceEngine`: a model converted to the inference dtype, sharded by AutoTP, placed on this rank's device.

What happens at construction, in order (DeepSpeed's): the module is converted to `config.dtype`; the
tensor-parallel group is found (the mpu's model-parallel group, `tp_group`, or one made of consecutive
ranks when `tp_size` > 1); AutoTP shards the module (ds-parallel, inference mode: frozen shards,
row-parallel output head); whole-model checkpoint files are loaded into the shards; the module moves
to this rank's device; and the random state is broadcast from rank 0, so sampling agrees across the
tensor-parallel ranks.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import torch
from torch import nn

import ds_comm
from ds_comm import get_accelerator
from ds_engine._inference.config import DeepSpeedInferenceConfig
from ds_engine._optional import require

logger = logging.getLogger(__name__)

__all__ = ["InferenceEngine"]


def _device() -> torch.device:
    acc = get_accelerator()
    return torch.device("cpu") if acc.name == "cpu" else acc.device(ds_comm.get_local_rank())


def _tp_group(config: DeepSpeedInferenceConfig) -> tuple[Any, int]:
    """(the tensor-parallel group or None, its size)."""
    tp = config.tensor_parallel
    if tp.mpu is not None:
        group = tp.mpu.get_model_parallel_group()
        return group, ds_comm.get_world_size(group)
    if tp.tp_group is not None:
        return tp.tp_group, ds_comm.get_world_size(tp.tp_group)
    if tp.tp_size <= 1:
        return None, 1
    ds_comm.init_distributed(verbose=False)
    if get_accelerator().name != "cpu":  # nccl groups bind to the current device
        get_accelerator().set_device(ds_comm.get_local_rank())
    world = ds_comm.get_world_size()
    if world % tp.tp_size:
        raise ValueError(f"init_inference: tensor_parallel.tp_size={tp.tp_size} does not divide the world size {world}")
    ds_parallel = require(
        "ds_parallel", extra="parallel", feature=f"init_inference(tensor_parallel.tp_size={tp.tp_size})"
    )
    return ds_parallel.build_mesh(tp=tp.tp_size).group("tp"), tp.tp_size


def _checkpoint_files(config: DeepSpeedInferenceConfig) -> list[str]:
    spec = config.checkpoint
    base = config.base_dir
    if isinstance(spec, str):
        base = base or os.path.dirname(os.path.abspath(spec))
        with open(spec) as f:
            spec = json.load(f)
    if not isinstance(spec, dict):
        raise ValueError(f"init_inference: checkpoint must be a dict or a JSON file path, got {type(spec).__name__}")
    kind = spec.get("type", "ds_model")
    if str(kind).lower() not in ("ds_model", "bloom"):
        raise ValueError(f"init_inference: checkpoint type {kind!r} is not supported by ds (only 'ds_model' / 'bloom')")
    files = spec.get("checkpoints")
    if isinstance(files, str):
        files = [files]
    if not files:
        raise ValueError("init_inference: the checkpoint description has no 'checkpoints' list of files")
    return [os.path.join(base, f) for f in files]


def _load_checkpoint(module: nn.Module, config: DeepSpeedInferenceConfig, sharded: bool) -> None:
    """Load whole-model state dicts into the (possibly sharded) module; every key must be covered once."""
    expected = set(module.state_dict())
    seen: set[str] = set()
    for path in _checkpoint_files(config):
        state = torch.load(path, map_location="cpu", weights_only=False)
        if isinstance(state, dict) and ("module" in state or "model" in state):
            state = state["module" if "module" in state else "model"]
        state = {k: v.to(config.dtype) if v.is_floating_point() else v for k, v in state.items()}
        if sharded:
            ds_parallel = require("ds_parallel", extra="parallel", feature="init_inference(checkpoint=...)")
            ds_parallel.tensor.load_full_state_dict(module, state, strict=False)
        else:
            module.load_state_dict(state, strict=False)
        seen.update(k for k in state if k in expected)
    missing = sorted(expected - seen)
    if missing:
        raise KeyError(f"init_inference: the checkpoint files do not hold {len(missing)} weights: {missing[:8]}")


class InferenceEngine(nn.Module):
    """The module prepared for inference; call it as the module, or `generate` as the module's.

    Args:
        model: the original `nn.Module` (a Hugging Face model, or any module AutoTP can shard).
        config: the validated `DeepSpeedInferenceConfig`.

    Raises:
        ValueError: the dtype is not supported on this accelerator, an injection policy names a layer
            the model does not have, or AutoTP cannot shard the model (the message names the layer).
    """

    def __init__(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        super().__init__()
        self.module = model
        self._config = config
        self.config = getattr(model, "config", None) if config.config is None else config.config
        self._check_dtype(config.dtype)
        model.to(config.dtype)
        self.mp_group, self.mp_world_size = _tp_group(config)
        self.mpu = config.tensor_parallel.mpu
        if self.mp_world_size > 1:
            self._shard(model, config)
        if config.checkpoint is not None:
            _load_checkpoint(model, config, sharded=self.mp_world_size > 1)
        if not config.keep_module_on_host:
            model.to(_device())
        if self.mp_world_size > 1:
            self._sync_rng()
        self._model_times: list[float] = []
        if hasattr(model, "generate"):
            self.generate = self._generate

    @staticmethod
    def _check_dtype(dtype: torch.dtype) -> None:
        acc = get_accelerator()
        ok = {torch.float32: True, torch.float16: acc.is_fp16_supported(), torch.bfloat16: acc.is_bf16_supported()}
        if not ok.get(dtype, False):
            raise ValueError(f"init_inference: dtype {dtype} is not supported by the {acc.name} accelerator")

    def _shard(self, model: nn.Module, config: DeepSpeedInferenceConfig) -> None:
        tensor = require("ds_parallel", extra="parallel", feature="init_inference tensor parallelism").tensor
        policies = None
        if config.injection_policy:
            names = [name for name, _ in model.named_modules()]
            policies = []
            for block, rows in config.injection_policy.items():
                rows = (rows,) if isinstance(rows, str) else tuple(rows)
                if not (isinstance(block, type) and issubclass(block, nn.Module)):
                    raise TypeError(f"init_inference: injection_policy key {block!r} is not an nn.Module class")
                for row in rows:
                    if not any(n.endswith(row) for n in names):
                        raise ValueError(f"init_inference: injection policy layer {row!r} is not in the model")
                policies.append(tensor.BlockPolicy(block, frozenset(rows)))
        tensor.shard_model(
            model,
            tp_group=self.mp_group,
            training=False,
            tp_grain_size=config.tensor_parallel.tp_grain_size,
            policies=policies,
        )

    @staticmethod
    def _sync_rng() -> None:
        """Every rank samples as rank 0 does (the accelerator's generator; a collective on the world)."""
        acc = get_accelerator()
        state = acc.get_rng_state().to(_device())  # nccl broadcasts device tensors only
        ds_comm.broadcast(state, 0)
        acc.set_rng_state(state.cpu())

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's forward (one all-reduce per row-parallel layer on the tensor-parallel group)."""
        return self.module(*inputs, **kwargs)

    def _generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The module's `generate`, with DeepSpeed's checks: no beam search, prompts within `max_out_tokens`."""
        num_beams = getattr(kwargs.get("generation_config"), "num_beams", 1)
        num_beams = kwargs.get("num_beams", num_beams)
        if num_beams > 1:
            raise NotImplementedError("InferenceEngine.generate: num_beams > 1 is not supported (as in DeepSpeed)")
        ids = kwargs.get("input_ids")
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[-1] > self._config.max_out_tokens:
            raise RuntimeError(
                f"Input with size {ids.shape[-1]} exceeds maximum length of {self._config.max_out_tokens}. "
                "Please increase max_tokens in the DeepSpeed Inference Config."
            )
        return self.module.generate(*inputs, **kwargs)  # type: ignore[operator]
