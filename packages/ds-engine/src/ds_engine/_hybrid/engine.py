"""`DeepSpeedHybridEngine`: the training engine that also generates fast (RLHF actor models).

An RLHF loop alternates generation (experience) with training steps on one model. Under ZeRO-3 a
plain `model.generate` gathers and releases every layer's parameters again for every new token, so
generation costs (tokens x layers) all-gathers. The hybrid engine's `generate()` gathers every
parameter once for the whole call (`hybrid_engine.pin_parameters`), takes ZeRO-3's per-module hooks
off while the model generates, and releases the parameters (partitioned again, memory back) when it
returns. At stages 0-2 the parameters are whole already and it just generates.

DeepSpeed's engine also swaps supported layers for its CUDA inference kernels; ds runs the model's
own forward (its `generate`, from Hugging Face), which is why it works for any model with a
`generate` method. LoRA layers in DeepSpeed-Chat's convention are merged into their base weights
for the call and restored bit for bit afterwards (`_hybrid_lora`).

As in DeepSpeed, the wrapped module's `generate` is replaced by the engine's, so scripts that call
`engine.module.generate(...)` (DeepSpeed-Chat does) take the same path.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

import ds_comm
from ds_comm import get_accelerator
from ds_engine._engine.assembly import EngineParts
from ds_engine._engine.engine import DeepSpeedEngine
from ds_engine._engine.offload_states import FORWARD_NEEDS
from ds_engine._hybrid.lora import LoraFusion, find_lora_layers
from ds_engine._optional import require

logger = logging.getLogger(__name__)

__all__ = ["DeepSpeedHybridEngine"]


def _sync_rng(device: torch.device) -> None:
    """Every rank takes rank 0's accelerator RNG state (sampling draws the same on all ranks, as in DeepSpeed)."""
    if not ds_comm.is_initialized() or ds_comm.get_world_size() == 1:
        return
    acc = get_accelerator()
    state = acc.get_rng_state().to(device)
    ds_comm.broadcast(state, src=0)
    acc.set_rng_state(state.cpu())


def _batch_size(inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    ids = inputs[0] if inputs else kwargs.get("input_ids")
    return int(ids.shape[0]) if isinstance(ids, torch.Tensor) and ids.dim() > 0 else None


class DeepSpeedHybridEngine(DeepSpeedEngine):
    """DeepSpeed's hybrid engine: `DeepSpeedEngine` plus `generate()` (built by `initialize()` when
    `"hybrid_engine": {"enabled": true}`).

    Attributes (DeepSpeed's names): `Z3_enabled` (ZeRO stage 3), `gather_all_layers` (the
    `pin_parameters` switch), `all_lora_params` (the LoRA factors found in the model), `is_lora_fused`.
    """

    inference_mp_group = None

    def __init__(self, parts: EngineParts) -> None:
        super().__init__(parts)
        he = parts.config.hybrid_engine
        ds_comm.warn_ignored(he, path="hybrid_engine")
        _sync_rng(self.device)
        self.Z3_enabled = parts.config.zero.stage == 3
        self.gather_all_layers = he.pin_parameters
        self._release_cache = he.release_inference_cache
        self.mp_group = None
        self._lora = LoraFusion(find_lora_layers(self.module))
        self.all_lora_params = [p for layer in self._lora.layers for p in layer.params]
        self.is_lora_fused = False
        # latency accounting, reported by eval() as DeepSpeed's engine does
        self._t_start: float | None = None
        self._total_latency = 0.0
        self._iters = 0
        self._training_start_time: float | None = None
        self._generate_latency = 0.0
        self._training_latency = 0.0
        self._gather_latency = 0.0
        self._total_batch_size: int | None = None
        generate = getattr(self.module, "generate", None)
        self._generate = generate if callable(generate) else None
        if self._generate is not None:
            self.module.generate = self.generate  # type: ignore[assignment]

    # -- generation -------------------------------------------------------------------------------------
    def generate(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped module's `generate(*inputs, **kwargs)`, with its parameters gathered once (ZeRO-3).

        Every rank of the data-parallel group must call it (the gather and release are collectives); with
        `pin_parameters` each rank then generates on its own, and may stop after a different number of
        tokens. Without it (ZeRO-3) the per-layer gathers run for every token, so every rank must run the
        same number of forwards (pass `synced_gpus=True` to Hugging Face's `generate` when prompts may
        finish at different lengths).

        Raises:
            AttributeError: the wrapped module has no `generate` method.
            StatesOffloadedError: the parameters are offloaded (`reload_states()` first).
        """
        if self._generate is None:
            raise AttributeError(
                f"engine.generate(): the wrapped module ({type(self.module).__name__}) has no generate() method "
                "(a Hugging Face PreTrainedModel has one)"
            )
        self._check_states_loaded("engine.generate()", FORWARD_NEEDS)
        if self._total_batch_size is None:
            bsz = _batch_size(inputs, kwargs)
            if bsz is not None:
                self._total_batch_size = bsz * self._dist.dp_world_size
        t0 = time.time()
        self._gather_latency = 0.0
        if self.Z3_enabled and self.gather_all_layers:
            with self._gathered_without_hooks():
                self._gather_latency = time.time() - t0
                out = self._generate_fused(inputs, kwargs)
        elif self.Z3_enabled:
            out = self._generate(*inputs, **kwargs)  # LoRA stays unfused: the weights come and go per layer
        else:
            out = self._generate_fused(inputs, kwargs)
        if self._release_cache:
            gc.collect()
            get_accelerator().empty_cache()
        self._generate_latency = time.time() - t0 - self._gather_latency
        return out

    @contextlib.contextmanager
    def _gathered_without_hooks(self) -> Iterator[None]:
        ds_zero = require("ds_zero", extra="zero", feature="the hybrid engine at ZeRO stage 3")
        with ds_zero.unwrap_model_for_generation(self.module):
            yield

    def _generate_fused(self, inputs: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if not self._lora.layers:
            return self._generate(*inputs, **kwargs)  # type: ignore[misc]
        self.fuse_lora_weight()
        try:
            return self._generate(*inputs, **kwargs)  # type: ignore[misc]
        finally:
            self.unfuse_lora_weight()

    # -- LoRA -------------------------------------------------------------------------------------------
    def fuse_lora_weight(self) -> None:
        """Merge every LoRA layer's factors into its base weight (the layers then run as plain linears).

        Under ZeRO-3 the weights must be gathered (generate() does it); `unfuse_lora_weight()` undoes it.
        """
        self._check_lora_weights_gathered()
        self._lora.fuse()
        self.is_lora_fused = True

    def unfuse_lora_weight(self) -> None:
        """Give every LoRA layer back its base weight, bit for bit, and its own forward."""
        self._lora.unfuse()
        self.is_lora_fused = False

    def _check_lora_weights_gathered(self) -> None:
        if not self.Z3_enabled:
            return
        ds_zero = require("ds_zero", extra="zero", feature="the hybrid engine at ZeRO stage 3")
        for layer in self._lora.layers:
            weight: Any = layer.module.weight
            for p in (weight, *layer.params):
                if ds_zero.is_zero_param(p) and p.ds_status is not ds_zero.ZeroParamStatus.AVAILABLE:
                    raise RuntimeError(
                        f"fuse_lora_weight(): the parameters of LoRA layer {layer.name!r} are partitioned; under "
                        "ZeRO-3 fuse inside deepspeed.zero.GatheredParameters(...) (engine.generate() does)"
                    )

    # -- mode switches (DeepSpeed's latency report) ------------------------------------------------------
    def eval(self) -> DeepSpeedHybridEngine:
        """Switch to evaluation (generation); from the second call on, log the last round's latency split."""
        if self._t_start is not None:
            latency = time.time() - self._t_start
            self._total_latency += latency
            self._iters += 1
            if self._dist.global_rank == 0:
                logger.info(self._latency_line(latency))
            self._t_start = time.time()
        self._training_latency = 0.0
        super().eval()
        if self.Z3_enabled:
            gc.collect()
            get_accelerator().empty_cache()
        if self._t_start is None:
            self._t_start = time.time()
        return self

    def _latency_line(self, latency: float) -> str:
        def share(t: float) -> str:
            return f"{t:.2f}s ({100 * t / latency:.2f}%)" if latency > 0 else f"{t:.2f}s"

        others = latency - (self._generate_latency + self._training_latency)
        line = (
            f"|E2E latency={latency:.2f}s |Gather latency={share(self._gather_latency)} "
            f"|Generate time={share(self._generate_latency)} |Training time={share(self._training_latency)} "
            f"|Others={share(others)}"
        )
        if self._total_batch_size is not None and latency > 0:
            avg = self._total_latency / self._iters
            line += (
                f" |CurSamplesPerSec={self._total_batch_size / latency:.2f}"
                f" |AvgSamplesPerSec={self._total_batch_size / avg:.2f}"
            )
        return line

    def train(self, mode: bool = True) -> DeepSpeedHybridEngine:
        super().train(mode)
        if mode:
            self._training_start_time = time.time()
        return self

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        super().step(lr_kwargs=lr_kwargs)
        if self._training_start_time is not None:
            now = time.time()
            self._training_latency += now - self._training_start_time
            self._training_start_time = now
