"""ALST for Hugging Face models (`deepspeed.runtime.sequence_parallel.ulysses_sp`).

Arctic Long Sequence Training wraps DeepSpeed-Ulysses for `transformers` models without touching their
code. `UlyssesSPAttentionHF.register_with_transformers(...)` puts the Ulysses exchange around the core
attention under the core's own name: a model loaded as usual with `attn_implementation="sdpa"` (or
flash/flex attention) runs sequence-parallel, and every `transformers` code path that branches on the
implementation's name still takes its branch. (ds also registers the same function as "ulysses", and
supports "eager" as a core.) It returns the mpu to pass to `initialize(mpu=...)`.
`UlyssesSPDataLoaderAdapter` turns each rank's batches into sequence shards for its SP group, with
pre-shifted `shift_labels` in place of `labels`; `aggregate_sp_loss` combines the shards' losses into the
whole sequence's; `TiledMLP` and `TiledFusedLogitsLoss` bound the MLP's and the logits' activation memory by
tiling the sequence, and `sequence_tiled_compute` does the same for any function local along the sequence.

`transformers` is needed only by `register_with_transformers` (imported there).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel import groups
from ds_parallel._sp_dataloader import UlyssesSPDataLoaderAdapter
from ds_parallel._tiled_compute import SequenceTiledCompute, sequence_tiled_compute
from ds_parallel._tiling import TiledFusedLogitsLoss, TiledMLP
from ds_parallel.mpu import MeshMPU
from ds_parallel.sequence import all_gather_autograd, seq_all_to_all

__all__ = [
    "SequenceTiledCompute",
    "TiledFusedLogitsLoss",
    "TiledMLP",
    "UlyssesSPAttentionHF",
    "UlyssesSPDataLoaderAdapter",
    "aggregate_sp_loss",
    "sequence_tiled_compute",
]

logger = logging.getLogger(__name__)

ATTN_NAME = "ulysses"
# The core attention a registered wrapper runs, kept on the wrapper so a second registration (the
# name's entry is then a wrapper) wraps the core again, not the wrapper.
_CORE_ATTR = "_ulysses_core"


def _eager_core(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **_: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal softmax attention on `[b, h, s, d]` (kv heads repeated for GQA); returns `[b, s, h, d]`."""
    groups_per_kv = query.size(1) // key.size(1)
    key = key.repeat_interleave(groups_per_kv, dim=1)
    value = value.repeat_interleave(groups_per_kv, dim=1)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.size(-1))
    scores = (query @ key.transpose(-1, -2)) * scale
    s_q, s_k = scores.shape[-2:]
    causal = torch.ones(s_q, s_k, dtype=torch.bool, device=scores.device).triu(s_k - s_q + 1)
    weights = scores.masked_fill(causal, float("-inf")).softmax(-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    return (weights @ value).transpose(1, 2).contiguous(), weights


class UlyssesSPAttentionHF(nn.Module):
    """The Ulysses attention: all-to-all, the core attention on whole sequences, all-to-all.

    Called by the model's attention layers with `query/key/value` of `[b, h, s/P, d]` (this rank's sequence
    shard, RoPE already applied from the shard's `position_ids`); returns `([b, s/P, h, d], weights)` with
    the core's weights (None for sdpa/flash). The core sees `position_ids` of the whole sequence and no
    mask: it is causal over the whole sequence (flex attention gets a causal block mask of that length).

    Args:
        attn: the core attention, HF's signature `(module, q, k, v, attention_mask, **kwargs) -> (out, weights)`.
        batch_size: the micro-batch size (recorded).
        attn_head_count: the model's query heads, a multiple of P.
        attn_head_size: head dim.
        kv_head_count: key/value heads: a multiple of P, or a divisor of P (each then serves P / kv ranks:
            it is replicated before the exchange).
        num_hidden_layers: layer count (recorded).
        process_group: the sequence-parallel group.
        seq_length_is_variable: False: every call has `local_seq_length` tokens per rank (checked).
        local_seq_length, global_seq_length: the fixed lengths when not variable.
        disable_in_eval: in eval mode run the core attention on the (then unsharded) inputs directly.
    """

    def __init__(
        self,
        attn: Callable[..., Any],
        batch_size: int | None,
        attn_head_count: int,
        attn_head_size: int,
        kv_head_count: int,
        num_hidden_layers: int,
        process_group: ProcessGroup,
        seq_length_is_variable: bool = False,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = ds_comm.get_world_size(process_group)
        self.sp_rank = ds_comm.get_rank(process_group)
        if attn_head_count % self.world_size:
            raise ValueError(
                f"UlyssesSPAttentionHF: attn_head_count={attn_head_count} is not a multiple of the "
                f"sequence-parallel size {self.world_size}; choose a sequence_parallel_size that divides it"
            )
        if kv_head_count % self.world_size and self.world_size % kv_head_count:
            raise ValueError(
                f"UlyssesSPAttentionHF: kv_head_count={kv_head_count} neither divides nor is a multiple of "
                f"the sequence-parallel size {self.world_size}; choose a sequence_parallel_size that does"
            )
        if not seq_length_is_variable and local_seq_length is None:
            raise ValueError(
                "UlyssesSPAttentionHF: seq_length_is_variable=False needs local_seq_length (the fixed "
                "per-rank sequence length); pass it, or seq_length_is_variable=True"
            )
        self.attn_head_count, self.kv_head_count = attn_head_count, kv_head_count
        self.attn_head_size, self.num_hidden_layers = attn_head_size, num_hidden_layers
        self.batch_size, self.seq_length_is_variable = batch_size, seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval
        self.kv_replication_factor = max(self.world_size // kv_head_count, 1)
        self.core_attn_implementation: str | None = None  # set by register_with_transformers
        self._block_mask: tuple[tuple[Any, ...], Any] | None = None

    def _to_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[b, h, s/P, d] -> [b, h/P, s, d]."""
        heads = [t.size(1) // self.world_size] * self.world_size
        return seq_all_to_all(
            t,
            self.process_group,
            scatter_dim=1,
            gather_dim=2,
            scatter_sizes=heads,
            gather_sizes=[t.size(2)] * self.world_size,
        )

    def _gather_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[..., s/P] -> [..., s]: the SP group's shards of the positions, in rank order."""
        pieces = torch.empty(
            (self.world_size, *position_ids.shape), dtype=position_ids.dtype, device=position_ids.device
        )
        ds_comm.all_gather_into_tensor(pieces, position_ids.contiguous().unsqueeze(0), group=self.process_group)
        return torch.cat(list(pieces.unbind(0)), dim=-1)

    def _causal_block_mask(self, query: torch.Tensor) -> Any:
        """flex attention's causal `BlockMask` for the whole sequence (built once per batch x length)."""
        from torch.nn.attention.flex_attention import create_block_mask

        batch, seq = query.size(0), query.size(2)
        cache_key = (batch, seq, query.device)
        if self._block_mask is None or self._block_mask[0] != cache_key:

            def causal(b: Any, h: Any, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
                return q_idx >= kv_idx

            mask = create_block_mask(causal, B=batch, H=None, Q_LEN=seq, KV_LEN=seq, device=query.device)
            self._block_mask = (cache_key, mask)
        return self._block_mask[1]

    def _check_inputs(self, query: torch.Tensor, kwargs: dict[str, Any]) -> None:
        if not torch.is_tensor(kwargs.get("position_ids")):
            raise ValueError(
                "UlyssesSPAttentionHF: the attention call has no position_ids; the core attention needs the "
                "whole sequence's positions (arange(seq_len) per sample, restarting at each packed sample): "
                "return them from the data collator or use UlyssesSPDataLoaderAdapter"
            )
        if not self.seq_length_is_variable and query.size(2) != self.local_seq_length:
            raise ValueError(
                f"UlyssesSPAttentionHF: seq_length_is_variable=False expects {self.local_seq_length} tokens per "
                f"rank (seq_length {self.global_seq_length} / {self.world_size}), got {query.size(2)}; "
                "register with seq_length_is_variable=True for batches of varying length"
            )

    def forward(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, Any]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        self._check_inputs(query, kwargs)
        kwargs["position_ids"] = self._gather_positions(kwargs["position_ids"])
        replicate = self.kv_replication_factor
        if replicate > 1:  # fewer kv heads than ranks: each rank gets a copy of its queries' kv head
            key, value = key.repeat_interleave(replicate, dim=1), value.repeat_interleave(replicate, dim=1)
        q, k, v = self._to_heads(query), self._to_heads(key), self._to_heads(value)
        if self.core_attn_implementation == "flex_attention":
            attention_mask = self._causal_block_mask(q)
        groups_before = getattr(module, "num_key_value_groups", None)
        if replicate > 1:  # cores that repeat kv heads read the module's ratio; this rank's differs
            setattr(module, "num_key_value_groups", q.size(1) // k.size(1))  # noqa: B010
        try:
            out, weights = self.attn(module, q, k, v, attention_mask, *args, **kwargs)  # [b, s, h/P, d]
        finally:
            if replicate > 1:
                setattr(module, "num_key_value_groups", groups_before)  # noqa: B010
        out = seq_all_to_all(
            out,
            self.process_group,
            scatter_dim=1,
            gather_dim=2,
            scatter_sizes=[query.size(2)] * self.world_size,
            gather_sizes=[out.size(2)] * self.world_size,
        )
        return out, weights

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int | None = None,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
        max_length: int | None = None,
    ) -> MeshMPU | None:
        """Build the mesh with `sp=sequence_parallel_size`, put Ulysses around the core attention, return the mpu.

        The wrapper replaces `core_attn_implementation`'s entry in transformers' attention registry (and is
        registered as "ulysses" too): models loaded with that implementation, before or after this call,
        run sequence-parallel; the mask `transformers` builds for the shard is dropped (attention is causal
        over the whole sequence, packed samples are told apart by `position_ids`).

        Args:
            model_name_or_path: a model path/name (its config is read with `AutoConfig`), a loaded model,
                or a `PretrainedConfig`.
            core_attn_implementation: the attention that runs on whole sequences: "sdpa", "flash_attention_2",
                "flex_attention", ... (any key of transformers' attention registry), or "eager".
            sequence_parallel_size: P; the world size must be a multiple of it.
            micro_batch_size: the micro-batch size (recorded).
            seq_length: the global sequence length when it is fixed (needed with `seq_length_is_variable=False`).
            seq_length_is_variable: batches may differ in length (shapes are read from each call).
            disable_in_eval: run unsharded in eval mode.
            max_length: deprecated spelling of `seq_length`.

        Returns:
            The `MeshMPU` for `initialize(mpu=...)`; None when `sequence_parallel_size` is 1 (nothing to do).

        Raises:
            ValueError: an unknown core attention, a loaded model using another attention, a fixed length
                without `seq_length`, or head counts P does not fit.
        """
        if sequence_parallel_size == 1:
            return None
        if max_length is not None:
            logger.warning("register_with_transformers: max_length is deprecated; pass seq_length instead")
            seq_length = max_length if seq_length is None else seq_length
        if not seq_length_is_variable and seq_length is None:
            raise ValueError(
                "register_with_transformers: seq_length_is_variable=False needs seq_length (the fixed global "
                "sequence length); pass seq_length, or seq_length_is_variable=True"
            )
        if not seq_length_is_variable and seq_length is not None and seq_length % sequence_parallel_size:
            raise ValueError(
                f"register_with_transformers: seq_length={seq_length} is not a multiple of "
                f"sequence_parallel_size={sequence_parallel_size}; pad the sequences to a multiple"
            )
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        core = _core_attention(core_attn_implementation)
        config = _text_config(model_name_or_path, core_attn_implementation)
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        mesh = groups.initialize_mesh(sp=sequence_parallel_size)
        mpu = MeshMPU(mesh)
        fixed = not seq_length_is_variable
        ulysses = cls(
            core,
            micro_batch_size,
            heads,
            head_dim,
            kv_heads,
            config.num_hidden_layers,
            mpu.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=seq_length // sequence_parallel_size if fixed and seq_length else None,
            global_seq_length=seq_length if fixed else None,
            disable_in_eval=disable_in_eval,
        )
        ulysses.core_attn_implementation = core_attn_implementation

        def ulysses_attention(
            module: nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: Any,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            # transformers built `attention_mask` for this rank's shard; it does not apply to whole sequences.
            return ulysses(module, query, key, value, None, *args, **kwargs)

        setattr(ulysses_attention, _CORE_ATTR, core)
        ALL_ATTENTION_FUNCTIONS[core_attn_implementation] = ulysses_attention
        AttentionInterface.register(ATTN_NAME, ulysses_attention)
        AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)
        return mpu


def _core_attention(name: str) -> Callable[..., Any]:
    """The core attention function registered under `name` (unwrapped if a registration wrapped it)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return _eager_core
    if name == "paged|eager" or name == ATTN_NAME or name not in ALL_ATTENTION_FUNCTIONS:
        known = sorted(k for k in [*ALL_ATTENTION_FUNCTIONS.keys(), "eager"] if k not in (ATTN_NAME, "paged|eager"))
        raise ValueError(f"register_with_transformers: core_attn_implementation={name!r} is not one of {known}")
    fn = ALL_ATTENTION_FUNCTIONS[name]
    return getattr(fn, _CORE_ATTR, fn)


def _text_config(model_name_or_path: Any, core_attn_implementation: str) -> Any:
    """The (text) config of a model, config or model path; a loaded model must use the core attention."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(model_name_or_path, PretrainedConfig):
        config = model_name_or_path
    elif hasattr(model_name_or_path, "config"):
        config = model_name_or_path.config
        used = getattr(config, "_attn_implementation", None)
        if used is not None and used not in (core_attn_implementation, ATTN_NAME):
            raise ValueError(
                f"register_with_transformers: core_attn_implementation={core_attn_implementation!r} but the "
                f"model was loaded with attn_implementation={used!r}; load it with "
                f"attn_implementation={core_attn_implementation!r} (or pass that core) so its attention "
                "calls run sequence-parallel"
            )
    else:
        config = AutoConfig.from_pretrained(model_name_or_path)
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else config


def aggregate_sp_loss(
    loss: torch.Tensor, shift_labels: torch.Tensor, group: ProcessGroup, ignore_index: int = -100
) -> torch.Tensor:
    """The whole sequence's mean loss from each rank's mean over its shard, differentiably.

    Each rank weighs its shard's loss by its count of real labels; the weighted sum over the SP group
    divided by the total count is the loss over every token of the sequence. The all-gather is
    differentiable, so every rank's backward reaches every shard (gradients across the SP group then
    add up to SP x the loss's gradient, which the engine's reduction over data x sequence ranks divides out).
    A shard with no real labels (loss NaN from an empty mean) counts as zero.

    `loss` is this shard's mean loss over `shift_labels`: `model.loss_function(logits=out.logits,
    labels=None, shift_labels=batch["shift_labels"], vocab_size=...)` (the adapter's batches carry no
    `labels`, so the model's forward computes none).
    """
    if not torch.is_tensor(loss):
        raise TypeError(
            f"aggregate_sp_loss: loss is {type(loss).__name__}, not a tensor; the model computes no loss from "
            "UlyssesSPDataLoaderAdapter's batches (they carry shift_labels, not labels): pass "
            "model.loss_function(logits=outputs.logits, labels=None, shift_labels=batch['shift_labels'], "
            "vocab_size=model.config.vocab_size)"
        )
    good = (shift_labels != ignore_index).sum().to(loss.dtype)
    weighted = torch.where(good > 0, loss * good, torch.zeros_like(loss))
    losses = all_gather_autograd(weighted, group)
    counts = all_gather_autograd(good, group)
    return losses.sum() / counts.sum().clamp(min=1)
