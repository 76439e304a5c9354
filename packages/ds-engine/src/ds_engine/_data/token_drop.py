"""`RandomLayerTokenDrop`: a wrapper that runs its layer on the tokens the random-LTD scheduler keeps.

In training, while the scheduler's kept length is below the sequence length, the wrapper gathers the
kept tokens (`token_ops`), runs the wrapped layer on them (with the attention mask cut to them when the
model passes one under `model_mask_name`) and scatters the layer's output back; the dropped tokens pass
through unchanged. The first random-LTD layer (id 0) draws the positions for every random-LTD layer of
this forward and leaves them in the scheduler's `state` (`sample_idx`, `attention_mask`), where the
later ones read them. In eval, or at full length, it is the wrapped layer.

`init_config` (called by the engine's `random_ltd_initialize`) gives the wrapper its scheduler, its
position among the random-LTD layers and the section's settings; until then it is the wrapped layer.

Arguments after the hidden states pass through as given; the mask is found by its parameter name
whether the model passes it by keyword or by position (Hugging Face's blocks take it positionally, where
DeepSpeed's wrapper, keyword-only, fails).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ds_engine._data import keys as k
from ds_engine._data.ltd_scheduler import RandomLTDScheduler
from ds_engine._data.token_ops import GatherTokens, ScatterTokens, bert_sample_tokens, gpt_sample_tokens

logger = logging.getLogger(__name__)

__all__ = ["HIDDEN_STATE_ORDERS", "MODEL_TYPES", "RandomLayerTokenDrop"]

_PATH = "data_efficiency.data_routing.random_ltd"

#: model_type -> how positions (and the mask over them) are drawn.
MODEL_TYPES: dict[str, Callable[..., Any]] = {"encoder": bert_sample_tokens, "decoder": gpt_sample_tokens}
#: hidden_state_order -> whether the batch is the first dim of the hidden states.
HIDDEN_STATE_ORDERS: dict[str, bool] = {"batch_seq_dim": True, "seq_batch_dim": False}


class RandomLayerTokenDrop(nn.Module):
    """Runs `layer` on the kept tokens during training (DeepSpeed's `RandomLayerTokenDrop`).

    The wrapped layer is `random_ltd_layer` (its state-dict keys gain `.random_ltd_layer`; the engine
    saves them without it, see `ltd_helpers.remove_random_ltd_state_dict`). It takes the hidden states
    first and returns a tensor or a tuple whose first item is the hidden states.
    """

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.random_ltd_layer = layer
        self.random_ltd_scheduler: RandomLTDScheduler | None = None
        self.random_ltd_layer_id = -1
        self.max_length: int | None = None
        self.reserved_length = -1
        self.curr_seq = -1
        self.curr_micro_batch = -1
        self.batch_first = False
        self.mask_name: str | None = None
        self.model_type: str | None = None
        self.micro_bs: int | None = None
        self.random_ltd_num_layer = 0
        self.index_generator: Callable[..., Any] | None = None
        self._layer_params: list[str] | None = None

    def init_config(self, config: Mapping[str, Any], scheduler: RandomLTDScheduler, random_ltd_layer_id: int) -> None:
        """Attach the scheduler; `random_ltd_layer_id` is this wrapper's position among the random-LTD layers.

        Raises:
            ValueError: `hidden_state_order` or `model_type` is not one DeepSpeed supports.
        """
        order = config.get(k.RANDOM_LTD_HIDDEN_STATE_ORDER)
        if order not in HIDDEN_STATE_ORDERS:
            raise ValueError(
                f"{_PATH}.{k.RANDOM_LTD_HIDDEN_STATE_ORDER}={order!r}: use one of {', '.join(HIDDEN_STATE_ORDERS)}"
            )
        model_type = config.get(k.RANDOM_LTD_MODEL_TYPE)
        if model_type not in MODEL_TYPES:
            raise ValueError(f"{_PATH}.{k.RANDOM_LTD_MODEL_TYPE}={model_type!r}: use one of {', '.join(MODEL_TYPES)}")
        self.random_ltd_scheduler = scheduler
        self.random_ltd_layer_id = random_ltd_layer_id
        self.max_length = scheduler.state[k.RANDOM_LTD_MAX_VALUE]
        self.mask_name = config.get(k.RANDOM_LTD_MODEL_MASK_NAME)
        self.micro_bs = config.get(k.RANDOM_LTD_MICRO_BATCH_SIZE)
        self.random_ltd_num_layer = scheduler.random_ltd_layer_num
        self.batch_first = HIDDEN_STATE_ORDERS[order]
        self.model_type = model_type
        self.index_generator = MODEL_TYPES[model_type]
        try:  # where a positional mask sits (read once: the wrapped layer's signature does not change)
            self._layer_params = list(inspect.signature(self.random_ltd_layer.forward).parameters)
        except (TypeError, ValueError):
            self._layer_params = None

    def get_bsh(self, hidden_states: torch.Tensor) -> None:
        self.curr_seq, self.curr_micro_batch = hidden_states.size(1), hidden_states.size(0)

    def get_sbh(self, hidden_states: torch.Tensor) -> None:
        self.curr_seq, self.curr_micro_batch = hidden_states.size(0), hidden_states.size(1)

    def get_hidden_tensor_shape(self, hidden_states: torch.Tensor) -> None:
        (self.get_bsh if self.batch_first else self.get_sbh)(hidden_states)

    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        scheduler = self.random_ltd_scheduler
        if scheduler is None:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        self.reserved_length = scheduler.get_current_seq()
        self.get_hidden_tensor_shape(hidden_states)
        if not self.training or self.reserved_length >= self.curr_seq:
            return self.random_ltd_layer(hidden_states, *args, **kwargs)
        args, kwargs, mask_at = self._find_mask(args, kwargs)
        mask = _read(args, kwargs, mask_at)
        indices, part_mask = self._positions(scheduler, hidden_states, mask)
        mine = indices[self.random_ltd_layer_id]
        hidden_states, kept = GatherTokens.apply(hidden_states, mine, self.batch_first)  # type: ignore[no-untyped-call]
        if mask is not None:
            cut = part_mask[self.random_ltd_layer_id] if self.model_type == "encoder" else part_mask
            args, kwargs = _write(args, kwargs, mask_at, cut)
        outputs = self.random_ltd_layer(kept, *args, **kwargs)
        if isinstance(outputs, torch.Tensor):
            return ScatterTokens.apply(hidden_states, outputs, mine, self.batch_first)  # type: ignore[no-untyped-call]
        if isinstance(outputs, tuple) and outputs and isinstance(outputs[0], torch.Tensor):
            merged = ScatterTokens.apply(hidden_states, outputs[0], mine, self.batch_first)  # type: ignore[no-untyped-call]
            return (merged, *outputs[1:])
        raise TypeError(
            f"RandomLayerTokenDrop: the wrapped {type(self.random_ltd_layer).__name__} returned "
            f"{type(outputs).__name__}; random-LTD needs the hidden states as a tensor or as the first item of a tuple"
        )

    def _find_mask(
        self, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any], int | str | None]:
        """Where the mask is in this call: a keyword (its name), a position in `args`, or None (not passed)."""
        name = self.mask_name
        if name is None:
            return args, kwargs, None
        if name in kwargs:
            return args, dict(kwargs), name
        params = self._layer_params
        if params is None:  # no introspectable signature: keyword-only, as DeepSpeed
            return args, kwargs, None
        if name in params and 0 < params.index(name) <= len(args):
            return args, kwargs, params.index(name) - 1  # the hidden states take the first parameter
        return args, kwargs, None

    def _positions(
        self, scheduler: RandomLTDScheduler, hidden_states: torch.Tensor, mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, Any]:
        """This forward's kept positions for every random-LTD layer: drawn by layer 0, shared through the scheduler."""
        if self.random_ltd_layer_id == 0:
            assert self.index_generator is not None  # set with the scheduler in init_config
            indices, part_mask = self.index_generator(
                self.reserved_length,
                self.curr_seq,
                self.curr_micro_batch,
                self.random_ltd_num_layer,
                hidden_states.device,
                mask,
            )
            scheduler.state[k.RANDOM_LTD_SAMPLE_INDEX] = indices
            scheduler.state[k.RANDOM_LTD_ATTENTION_MASK] = part_mask
            return indices, part_mask
        if k.RANDOM_LTD_SAMPLE_INDEX not in scheduler.state:
            raise RuntimeError(
                "RandomLayerTokenDrop: a random-LTD layer ran before the first one (id 0) drew this forward's "
                f"positions; {_PATH}.{k.RANDOM_LTD_LAYER_ID} must list the layers in the order the model runs them"
            )
        return scheduler.state[k.RANDOM_LTD_SAMPLE_INDEX], scheduler.state[k.RANDOM_LTD_ATTENTION_MASK]


def _read(args: tuple[Any, ...], kwargs: Mapping[str, Any], where: int | str | None) -> Any:
    if where is None:
        return None
    return kwargs[where] if isinstance(where, str) else args[where]


def _write(
    args: tuple[Any, ...], kwargs: dict[str, Any], where: int | str | None, value: Any
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if isinstance(where, str):
        kwargs[where] = value
    elif where is not None:
        args = (*args[:where], value, *args[where + 1 :])
    return args, kwargs
