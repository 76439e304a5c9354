"""`init_lora(model)` and `Init`: build a model's linear layers as `OptimizedLinear` while it is constructed.

Inside `with deepspeed.linear.Init(lora_config, quant_config):` every `torch.nn.Linear(...)` call builds
an `OptimizedLinear` with those configs instead (adapters delayed), so a large model never holds its
whole base weights on one rank: each layer is sharded and/or quantized as it is created. Hugging Face's
`AutoModelForCausalLM.from_pretrained` / `from_config` are wrapped for the same span so the model they
return has its adapters built (`init_lora`). Layers whose names match none of `lora_config.target_mods`
turn back into plain linear layers when the checkpoint is loaded into them.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import logging
from typing import Any

import torch
from torch import nn

from ds_engine._linear.config import LoRAConfig, QuantizationConfig
from ds_engine._linear.optimized_linear import LoRAOptimizedLinear, OptimizedLinear

logger = logging.getLogger(__name__)

__all__ = ["Init", "init_lora"]


def init_lora(model: nn.Module) -> None:
    """Freeze every parameter of `model`, then build the trainable adapters of each `LoRAOptimizedLinear`."""
    model.requires_grad_(False)
    for module in model.modules():
        if isinstance(module, LoRAOptimizedLinear):
            module.init_lora()


def _linear_factory(
    orig_linear: type[nn.Module], lora_config: LoRAConfig | None, quant_config: QuantizationConfig | None
) -> type:
    """A stand-in for `torch.nn.Linear` whose calls build `OptimizedLinear`s with these configs."""
    delayed = None if lora_config is None else dataclasses.replace(lora_config, delay_lora_init=True)

    class OptLinearWrapper:
        """Called as `nn.Linear(in_features, out_features, ...)`; returns an `OptimizedLinear`."""

        _orig_nn_linear = orig_linear
        _lora_config = delayed
        _quant_config = quant_config

        def __new__(cls, *args: Any, **kwargs: Any) -> nn.Module:  # type: ignore[misc]
            kwargs["lora_config"] = delayed
            kwargs["quantization_config"] = quant_config
            kwargs["linear_cls"] = orig_linear
            return OptimizedLinear(*args, **kwargs)

    return OptLinearWrapper


class Init:
    """Build linear layers as `OptimizedLinear` inside the `with` block (see the module docstring).

    Args:
        lora_config: LoRA for every linear layer built inside (None: quantization only).
        quant_config: quantized base weights (None: LoRA only).

    Example:
        with deepspeed.linear.Init(lora_config=LoRAConfig(lora_r=16, base_weight_sharding=world)):
            model = AutoModelForCausalLM.from_pretrained(name)
    """

    def __init__(self, lora_config: LoRAConfig | None = None, quant_config: QuantizationConfig | None = None) -> None:
        self.lora_config = lora_config
        self.quant_config = quant_config
        self._orig_nn_linear = torch.nn.Linear
        self._auto_model: Any = None
        self._orig_from_pretrained: Any = None
        self._orig_from_config: Any = None
        self._post_init_complete = False

    def _model_init(self, model: nn.Module) -> nn.Module:
        if self.lora_config is not None:
            init_lora(model)
        self._post_init_complete = True
        return model

    def _patch_transformers(self) -> None:
        if importlib.util.find_spec("transformers") is None:
            return
        auto = importlib.import_module("transformers").AutoModelForCausalLM
        self._auto_model = auto
        self._orig_from_pretrained, self._orig_from_config = auto.from_pretrained, auto.from_config
        orig_pretrained, orig_config = self._orig_from_pretrained, self._orig_from_config

        def from_pretrained(*args: Any, **kwargs: Any) -> nn.Module:
            return self._model_init(orig_pretrained(*args, **kwargs))

        def from_config(*args: Any, **kwargs: Any) -> nn.Module:
            return self._model_init(orig_config(*args, **kwargs))

        auto.from_pretrained, auto.from_config = from_pretrained, from_config

    def __enter__(self) -> Init:
        self._orig_nn_linear = torch.nn.Linear
        self._patch_transformers()
        # a stand-in class, not a subclass: its calls return OptimizedLinear modules
        torch.nn.Linear = _linear_factory(self._orig_nn_linear, self.lora_config, self.quant_config)  # type: ignore[misc, assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.nn.Linear = self._orig_nn_linear  # type: ignore[misc]
        if self._auto_model is not None:
            self._auto_model.from_pretrained = self._orig_from_pretrained
            self._auto_model.from_config = self._orig_from_config
            self._auto_model = None
        if not self._post_init_complete and self.lora_config is not None:
            logger.warning(
                "deepspeed.linear.Init: the LoRA adapters are not built yet (that happens by itself only for "
                "transformers' AutoModelForCausalLM.from_pretrained/from_config); call "
                "deepspeed.linear.init_lora(model) before training, or the forward will raise"
            )
