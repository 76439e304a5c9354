"""`OptimizedLinear`: a linear layer with LoRA adapters on a frozen, sharded and/or quantized base weight.

`OptimizedLinear(...)` returns the layer the configs ask for: a plain `linear_cls` (no config), a
`QuantizedLinear` (quantization only) or a `LoRAOptimizedLinear` (LoRA, quantized or not).

`LoRAOptimizedLinear` computes `x W^T + (lora_alpha / lora_r) * (x A^T) B^T` with `W` frozen and `A`
(`lora_weight_1`, kaiming-uniform) and `B` (`lora_weight_2`, zeros) trained, so a fresh layer computes
exactly `x W^T`. With `base_weight_sharding = N` (the world size) each rank keeps one contiguous
1/N slice of `W`'s row-major elements, as a flat tensor, and the forward all-gathers the full `W`
(without autograd: it is frozen). With quantization, the kept slice is packed small floats and is
dequantized before the gather, so the wire carries the weight's dtype.

[Note: seeded initialization] The base weight is drawn on each rank, for its own slice, from a
xavier-uniform whose fans are those of the slice viewed as `(input_dim / N, output_dim)`; then the two
adapter layers are built (each drawing its own default initialization) and `A` is redrawn. This is
DeepSpeed 0.19.8's order of random draws, so a model seeded the same way starts from the same numbers
on both. Real base weights come from a state dict (`load_state_dict` cuts each rank's slice out of
the full weight).
"""

from __future__ import annotations

import logging
import math
from dataclasses import is_dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn

from ds_comm import get_accelerator
from ds_engine import _comm as dist
from ds_engine._linear.config import LoRAConfig, QuantizationConfig, check_lora_config, check_quantization_config
from ds_engine._linear.quantization import QuantizedLinear, QuantizedParameter

logger = logging.getLogger(__name__)

__all__ = ["LoRAOptimizedLinear", "OptimizedLinear"]


class OptimizedLinear(nn.Module):
    """Factory for the linear layer the configs ask for (see the module docstring).

    Args:
        input_dim: in features.
        output_dim: out features.
        bias: a bias (not supported with LoRA).
        lora_config: LoRA rank, alpha, base-weight sharding and offload (`LoRAConfig`).
        quantization_config: the frozen base weight's storage format (`QuantizationConfig`).
        device: where the adapters live (the accelerator's current device when None).
        dtype: the parameters' dtype (bf16 by default).
        linear_cls: the class of plain and adapter layers (`deepspeed.linear.Init` passes the real
            `nn.Linear` while it has replaced `torch.nn.Linear`).
    """

    def __new__(  # type: ignore[misc]
        cls,
        input_dim: int,
        output_dim: int,
        bias: bool = False,
        lora_config: LoRAConfig | None = None,
        quantization_config: QuantizationConfig | None = None,
        device: Any = None,
        dtype: torch.dtype = torch.bfloat16,
        linear_cls: type[nn.Module] = nn.Linear,
    ) -> nn.Module:
        if quantization_config is not None and not is_dataclass(quantization_config):
            raise ValueError(f"Expecting QuantizationConfig but received {type(quantization_config)}")
        if lora_config is not None and not is_dataclass(lora_config):
            raise ValueError(f"Expecting LoRAConfig but received {type(lora_config)}")
        if lora_config is not None:
            return LoRAOptimizedLinear(
                input_dim=input_dim,
                output_dim=output_dim,
                bias=bias,
                lora_config=lora_config,
                quantization_config=quantization_config,
                device=device,
                dtype=dtype,
                linear_cls=linear_cls,
            )
        if quantization_config is not None:
            return QuantizedLinear(
                input_dim=input_dim,
                output_dim=output_dim,
                bias=bias,
                quantization_config=quantization_config,
                dtype=dtype,
            )
        return linear_cls(input_dim, output_dim, bias=bias, dtype=dtype, device=device)


class LoRAOptimizedLinear(nn.Module):
    """LoRA adapters over a frozen base weight that may be sharded over the ranks and quantized.

    Arguments are `OptimizedLinear`'s; `lora_config` is required and `bias` must be False.

    Raises:
        ValueError: bias=True, a bad config field (named), a sharding degree other than 1 or the
            world size, or an `input_dim` the degree does not divide.
    """

    def __init__(
        self,
        input_dim: int,
        output_dim: int,
        bias: bool = False,
        lora_config: LoRAConfig | None = None,
        quantization_config: QuantizationConfig | None = None,
        device: Any = None,
        dtype: torch.dtype = torch.bfloat16,
        linear_cls: type[nn.Module] = nn.Linear,
    ) -> None:
        super().__init__()
        if lora_config is None:
            raise ValueError("LoRAOptimizedLinear needs a lora_config (deepspeed.linear.LoRAConfig)")
        if bias:
            raise ValueError("LoRAOptimizedLinear: bias=True is not supported; build it with bias=False")
        self.lora_config = check_lora_config(lora_config)
        self.quantization_config = (
            None if quantization_config is None else check_quantization_config(quantization_config)
        )
        self.input_dim, self.output_dim, self.bias = input_dim, output_dim, bias
        self.device = get_accelerator().current_device_name() if device is None else device
        self.linear_cls, self.dtype = linear_cls, dtype
        self.zero_shards = self.lora_config.base_weight_sharding
        self.sharded_weight_size = self._check_sharding(input_dim)
        self.weight = self._new_base_weight()
        self.disabled = False
        self._initialized = False
        if not self.lora_config.delay_lora_init:
            self.init_lora()

    def _check_sharding(self, input_dim: int) -> int:
        if self.zero_shards == 1:
            return input_dim
        world = dist.get_world_size() if dist.is_initialized() else 1
        if self.zero_shards != world:
            raise ValueError(
                f"lora_config.base_weight_sharding={self.zero_shards}: base weight sharding is only supported "
                f"across the world size ({world}); set it to {world}, or 1 to keep whole base weights"
            )
        if input_dim % self.zero_shards:
            raise ValueError(
                f"lora_config.base_weight_sharding={self.zero_shards} does not divide input_dim={input_dim}; "
                "pick a sharding degree that divides the layer's in features"
            )
        return input_dim // self.zero_shards

    def _new_base_weight(self) -> nn.Parameter:
        whole = (self.output_dim, self.input_dim)
        shape = whole if self.zero_shards == 1 else (self.output_dim * self.sharded_weight_size,)
        w = nn.Parameter(torch.empty(shape, dtype=self.dtype), requires_grad=False)
        with torch.no_grad():  # fans of the slice seen as (in / N, out): see [Note: seeded initialization]
            nn.init.xavier_uniform_(w.view(self.sharded_weight_size, self.output_dim))
        if self.quantization_config is not None:
            return QuantizedParameter(w.data, quantization_config=self.quantization_config)
        return w

    def disable(self) -> None:
        """Turn into a plain linear layer with a whole (unsharded, unquantized) weight, to be loaded."""
        self.disabled = True
        whole = torch.empty((self.output_dim, self.input_dim), dtype=self.dtype)
        self.weight = nn.Parameter(whole, requires_grad=False)

    def init_lora(self) -> None:
        """Build the trainable adapters (`lora_weight_1` = A, `lora_weight_2` = B) and freeze the base weight."""
        if self.disabled:
            return
        if self.quantization_config is not None and not isinstance(self.weight, QuantizedParameter):
            # a framework may have replaced the parameter with a plain one while building the model
            self.weight = QuantizedParameter(self.weight.data, quantization_config=self.quantization_config)
        self._initialized = True
        self.weight.requires_grad = False
        self.weight.ds_optim_param = True  # type: ignore[attr-defined]  # the engine neither broadcasts nor trains it (each rank's own slice)
        rank = self.lora_config.lora_r
        self.lora_scaling_factor = self.lora_config.lora_alpha / rank
        self.lora_weight_1 = self.linear_cls(self.input_dim, rank, bias=False, device=self.device, dtype=self.dtype)
        self.lora_weight_2 = self.linear_cls(rank, self.output_dim, bias=False, device=self.device, dtype=self.dtype)
        nn.init.kaiming_uniform_(cast(torch.Tensor, self.lora_weight_1.weight), a=math.sqrt(5))
        nn.init.zeros_(cast(torch.Tensor, self.lora_weight_2.weight))
        self.lora_weight_1.weight.requires_grad = True
        self.lora_weight_2.weight.requires_grad = True

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """Load a whole base weight: keep this rank's slice, quantized if configured.

        A module whose name matches none of `lora_config.target_mods` turns back into a plain layer
        (`disable`) and loads the weight whole.
        """
        if not any(target in prefix for target in self.lora_config.target_mods):
            self.disable()
            return super()._load_from_state_dict(
                state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
            )
        key = f"{prefix}weight"
        incoming = state_dict.get(key)
        if incoming is not None and self._is_saved_slice(incoming):
            state_dict[key] = self._own_slice_for(incoming, key)
        elif incoming is not None and incoming.dtype != getattr(self.quantization_config, "q_dtype", None):
            state_dict[key] = self._local_slice_of(incoming)
        return super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )

    def _is_saved_slice(self, incoming: torch.Tensor) -> bool:
        """A sharded layer's own state dict (a checkpoint): one rank's slice, in the stored form."""
        return self.zero_shards > 1 and incoming.shape == self.weight.data.shape and incoming.dtype == self.weight.dtype

    def _own_slice_for(self, saved: torch.Tensor, key: str) -> torch.Tensor:
        """What to load from a checkpoint's slice: this rank's own, unchanged.

        [Note: checkpoints of sharded base weights] The engine's checkpoint holds rank 0's state dict,
        so the slice in it is rank 0's. The base weight is frozen, so the slice each rank built the model
        with (from the same pretrained weights, before resuming) is the one it trained with. Rank 0 checks
        that its slice is the saved one; a mismatch means the model was built from other base weights.
        """
        own = self.weight.data
        if dist.is_initialized() and dist.get_rank() == 0 and not torch.equal(saved.to(own.device), own):
            raise ValueError(
                f"{key}: the checkpoint's base-weight slice differs from this model's; build the model from the "
                "same base weights it was trained with (they are frozen and kept per rank), then load the checkpoint"
            )
        logger.debug("%s: keeping this rank's base-weight slice (the checkpoint holds rank 0's)", key)
        return own

    def _local_slice_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's stored form of a whole `(output_dim, input_dim)` weight: sliced, then quantized if configured."""
        local: torch.Tensor = full
        if full.numel() != self.output_dim * self.input_dim:
            raise ValueError(
                f"LoRAOptimizedLinear: the state dict's base weight has shape {tuple(full.shape)}; load the whole "
                f"({self.output_dim}, {self.input_dim}) weight (each rank keeps its own slice of it)"
            )
        if self.zero_shards > 1:
            if not dist.is_initialized():
                raise RuntimeError(
                    "OptimizedLinear base weight sharding needs torch.distributed: call deepspeed.init_distributed() "
                    "before loading a state dict"
                )
            size = self.output_dim * self.sharded_weight_size
            local = full.reshape(-1).narrow(0, dist.get_rank() * size, size)
        if isinstance(self.weight, QuantizedParameter):
            config = self.quantization_config
            assert config is not None, "a QuantizedParameter base weight is only built from a quantization_config"
            if self.weight.dtype == config.q_dtype:
                local = self.weight.quantizer.quantize(
                    local.to(self.dtype), q_bits=config.q_bits, q_mantisa_bits=config.mantissa_bits
                )
        return local

    def _local_weight(self) -> torch.Tensor:
        """This rank's base weight (or slice), dequantized, on the accelerator for the computation."""
        weight = self.weight
        offloaded = getattr(weight, "ds_offload", False)
        data: torch.Tensor = weight
        if offloaded:  # kept on the host: bring the stored form over, then dequantize there
            data = weight.data.to(self.device)
            if isinstance(weight, QuantizedParameter):
                config = weight.quantization_config
                return weight.quantizer.dequantize(data, q_bits=config.q_bits, q_mantisa_bits=config.mantissa_bits)
            return data
        return weight.dequantized() if isinstance(weight, QuantizedParameter) else data

    def full_weight(self) -> torch.Tensor:
        """The whole `(output_dim, input_dim)` base weight: this rank's slice all-gathered with the others'."""
        local = self._local_weight().reshape(-1)
        full = torch.empty(self.output_dim * self.input_dim, dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(full, local)
        return full.view(self.output_dim, self.input_dim)

    def forward(self, input_tensor: torch.Tensor) -> torch.Tensor:
        if self.disabled:
            return F.linear(input_tensor, self.weight)
        if not self._initialized:
            raise RuntimeError(
                "LoRAOptimizedLinear: the adapters were never built; call deepspeed.linear.init_lora(model) "
                "after building the model (needed with lora_config.delay_lora_init=True or deepspeed.linear.Init)"
            )
        with torch.no_grad():
            base_weight = self.full_weight() if self.zero_shards > 1 else self._local_weight()
        if base_weight.dtype != input_tensor.dtype and input_tensor.is_floating_point():
            base_weight = base_weight.to(input_tensor.dtype)  # a quantized weight dequantizes to its build dtype
        base = F.linear(input_tensor, base_weight)
        lora = self.lora_weight_2(self.lora_weight_1(input_tensor))
        return base + self.lora_scaling_factor * lora

    def extra_repr(self) -> str:
        return (
            f"input_dim={self.input_dim}, output_dim={self.output_dim}, lora_r={self.lora_config.lora_r}, "
            f"lora_alpha={self.lora_config.lora_alpha}, base_weight_sharding={self.zero_shards}, "
            f"quantized={self.quantization_config is not None}"
        )
