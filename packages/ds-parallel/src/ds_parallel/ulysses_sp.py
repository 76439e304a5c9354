"""ALST for Hugging Face models (`deepspeed.runtime.sequence_parallel.ulysses_sp`).

Arctic Long Sequence Training wraps DeepSpeed-Ulysses for `transformers` models without touching their
code: `UlyssesSPAttentionHF.register_with_transformers(...)` registers an attention implementation named
"ulysses" (load the model with `attn_implementation="ulysses"`) that trades sequence shards for head
shards around the model's own core attention (sdpa, eager, flash), and returns the mpu to pass to
`initialize(mpu=...)`; `UlyssesSPDataLoaderAdapter` turns each rank's batches into sequence shards for
its SP group; `aggregate_sp_loss` combines the shards' losses into the whole sequence's; `TiledMLP` and
`TiledFusedLogitsLoss` bound the MLP's and the logits' activation memory by tiling the sequence, and
`sequence_tiled_compute` does the same for any function that is local along the sequence.

`transformers` is needed only by `register_with_transformers` (imported there).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed import ProcessGroup

import ds_comm
from ds_parallel import groups
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

ATTN_NAME = "ulysses"


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
    """The "ulysses" attention implementation: all-to-all, the core attention on whole sequences, all-to-all.

    Called by the model's attention layers with `query/key/value` of `[b, h, s/P, d]` (this rank's sequence
    shard, RoPE already applied from the shard's `position_ids`); returns `([b, s/P, h, d], None)`.

    Args:
        attn: the core attention, HF's signature `(module, q, k, v, attention_mask, **kwargs) -> (out, weights)`.
        attn_head_count, kv_head_count: the model's query and key/value heads (multiples of P).
        attn_head_size: head dim.
        num_hidden_layers: layer count (recorded; DeepSpeed's signature).
        process_group: the sequence-parallel group.
        seq_length_is_variable, local_seq_length, global_seq_length, batch_size: DeepSpeed's shape hints;
            shapes are read from each call here, so they only document the expected input.
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
        seq_length_is_variable: bool = True,
        local_seq_length: int | None = None,
        global_seq_length: int | None = None,
        disable_in_eval: bool = False,
    ) -> None:
        super().__init__()
        self.attn = attn
        self.process_group = process_group
        self.world_size = ds_comm.get_world_size(process_group)
        self.sp_rank = ds_comm.get_rank(process_group)
        for name, heads in (("attn_head_count", attn_head_count), ("kv_head_count", kv_head_count)):
            if heads % self.world_size:
                raise ValueError(
                    f"UlyssesSPAttentionHF: {name}={heads} is not a multiple of the sequence-parallel "
                    f"size {self.world_size}; choose a sequence_parallel_size that divides it"
                )
        self.attn_head_count, self.kv_head_count = attn_head_count, kv_head_count
        self.attn_head_size, self.num_hidden_layers = attn_head_size, num_hidden_layers
        self.batch_size, self.seq_length_is_variable = batch_size, seq_length_is_variable
        self.local_seq_length, self.global_seq_length = local_seq_length, global_seq_length
        self.disable_in_eval = disable_in_eval

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

    def forward(
        self,
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        *args: Any,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        if self.disable_in_eval and not module.training:
            return self.attn(module, query, key, value, attention_mask, *args, **kwargs)
        q, k, v = self._to_heads(query), self._to_heads(key), self._to_heads(value)
        # Whole sequences are causal; the shard-sized mask HF built does not apply (ALST takes position_ids).
        kwargs.pop("is_causal", None)
        local = query.size(2)
        position_ids = kwargs.get("position_ids")
        if torch.is_tensor(position_ids) and position_ids.size(-1) == local:
            # Cores that read positions (flash attention finds packed samples from them) see whole sequences.
            kwargs["position_ids"] = self._gather_positions(position_ids)
        out, _ = self.attn(module, q, k, v, None, *args, **kwargs)  # [b, s, h/P, d]
        out = seq_all_to_all(
            out,
            self.process_group,
            scatter_dim=1,
            gather_dim=2,
            scatter_sizes=[local] * self.world_size,
            gather_sizes=[out.size(2)] * self.world_size,
        )
        return out, None

    @classmethod
    def register_with_transformers(
        cls,
        model_name_or_path: Any,
        core_attn_implementation: str,
        sequence_parallel_size: int,
        micro_batch_size: int | None = None,
        max_length: int | None = None,
        seq_length: int | None = None,
        seq_length_is_variable: bool = True,
        disable_in_eval: bool = False,
    ) -> MeshMPU | None:
        """Build the mesh with `sp=sequence_parallel_size`, register "ulysses" with transformers, return the mpu.

        Args:
            model_name_or_path: a model path/name (its config is read with `AutoConfig`), a
                `PretrainedConfig`, or a model.
            core_attn_implementation: the attention that runs on whole sequences: "sdpa", "eager",
                "flash_attention_2", ... (any key of transformers' attention registry, or "eager").
            sequence_parallel_size: P; the world size must be a multiple of it.
            micro_batch_size, max_length, seq_length, seq_length_is_variable: DeepSpeed's shape hints.
            disable_in_eval: run unsharded in eval mode.

        Returns:
            The `MeshMPU` for `initialize(mpu=...)`; None when `sequence_parallel_size` is 1 (nothing to do).

        Raises:
            ValueError: an unknown core attention, or head counts P does not divide.
        """
        if sequence_parallel_size == 1:
            return None
        from transformers import AutoConfig, PretrainedConfig
        from transformers.masking_utils import AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

        if core_attn_implementation == "eager":
            core = _eager_core
        elif core_attn_implementation in ALL_ATTENTION_FUNCTIONS and core_attn_implementation != ATTN_NAME:
            core = ALL_ATTENTION_FUNCTIONS[core_attn_implementation]
        else:
            known = sorted(k for k in [*ALL_ATTENTION_FUNCTIONS.keys(), "eager"] if k != ATTN_NAME)
            raise ValueError(
                f"register_with_transformers: core_attn_implementation={core_attn_implementation!r} "
                f"is not one of {known}"
            )
        config: Any
        if isinstance(model_name_or_path, PretrainedConfig):
            config = model_name_or_path
        elif isinstance(model_name_or_path, nn.Module) and hasattr(model_name_or_path, "config"):
            config = model_name_or_path.config
        else:
            config = AutoConfig.from_pretrained(model_name_or_path)
        config = getattr(config, "text_config", None) or config
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        mesh = groups.initialize_mesh(sp=sequence_parallel_size)
        mpu = MeshMPU(mesh)
        local = max_length // sequence_parallel_size if max_length else None
        ulysses = cls(
            core,
            micro_batch_size,
            heads,
            head_dim,
            kv_heads,
            config.num_hidden_layers,
            mpu.get_sequence_parallel_group(),
            seq_length_is_variable=seq_length_is_variable,
            local_seq_length=local,
            global_seq_length=max_length or seq_length,
            disable_in_eval=disable_in_eval,
        )

        def ulysses_attention(
            module: nn.Module,
            query: torch.Tensor,
            key: torch.Tensor,
            value: torch.Tensor,
            attention_mask: torch.Tensor | None,
            *args: Any,
            **kwargs: Any,
        ) -> Any:
            return ulysses(module, query, key, value, attention_mask, *args, **kwargs)

        AttentionInterface.register(ATTN_NAME, ulysses_attention)
        # No mask: the core attention is causal over the whole sequence (is_causal / its own mask).
        AttentionMaskInterface.register(ATTN_NAME, lambda *args, **kwargs: None)
        return mpu


def aggregate_sp_loss(
    loss: torch.Tensor, shift_labels: torch.Tensor, group: ProcessGroup, ignore_index: int = -100
) -> torch.Tensor:
    """The whole sequence's mean loss from each rank's mean over its shard, differentiably.

    Each rank weighs its shard's loss by its count of real labels; the weighted sum over the SP group
    divided by the total count is the loss over every token of the sequence. The all-gather is
    differentiable, so every rank's backward reaches every shard (gradients across the SP group then
    add up to SP x the loss's gradient, which the engine's reduction over data x sequence ranks divides out).
    A shard with no real labels (loss NaN from an empty mean) counts as zero.
    """
    good = (shift_labels != ignore_index).sum().to(loss.dtype)
    weighted = torch.where(good > 0, loss * good, torch.zeros_like(loss))
    losses = all_gather_autograd(weighted, group)
    counts = all_gather_autograd(good, group)
    return losses.sum() / counts.sum().clamp(min=1)


class UlyssesSPDataLoaderAdapter:
    """Wrap a DataLoader so each SP group processes its ranks' batches one after another, sequence-sharded.

    Every rank of an SP group loads its own batch (the loader is sharded over all ranks as usual); the
    adapter gathers the group's batches and yields, for each of them in rank order, this rank's 1/P slice
    along the sequence of every tensor, with `shift_labels` (labels moved left by one, `-100` last)
    computed on the whole sequence before slicing, and `position_ids` made when the batch has none. So
    the adapter yields P micro-batches per batch of the wrapped loader (`len()` says so).

    Args:
        dl: the DataLoader (batches are dicts of `[batch, seq]` tensors: input_ids, labels, position_ids...).
        sp_rank, sp_group, sp_world_size: this rank in the sequence-parallel group.
        device: where the yielded tensors go.
    """

    def __init__(
        self, dl: Any, sp_rank: int, sp_group: ProcessGroup, sp_world_size: int, device: torch.device | str
    ) -> None:
        self.dl, self.sp_rank, self.sp_group = dl, sp_rank, sp_group
        self.sp_world_size, self.device = sp_world_size, torch.device(device)

    def __len__(self) -> int:
        return len(self.dl) * self.sp_world_size

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for batch in self.dl:
            if not isinstance(batch, dict) or "input_ids" not in batch:
                raise TypeError(
                    f"UlyssesSPDataLoaderAdapter: batches must be dicts with 'input_ids', got {type(batch).__name__}"
                )
            mine = {k: (v.cpu() if torch.is_tensor(v) else v) for k, v in batch.items()}
            gathered: list[Any] = [None] * self.sp_world_size
            ds_comm.all_gather_object(gathered, mine, group=self.sp_group)
            for sample in gathered:
                yield self._shard(sample)

    def _shard(self, batch: dict[str, Any]) -> dict[str, torch.Tensor]:
        input_ids = batch["input_ids"]
        bs, seq = input_ids.shape[:2]
        if seq % self.sp_world_size:
            raise ValueError(
                f"UlyssesSPDataLoaderAdapter: sequence length {seq} is not a multiple of the "
                f"sequence-parallel size {self.sp_world_size}; pad the batch to a multiple"
            )
        batch = dict(batch)
        mask = batch.pop("attention_mask", None)
        if mask is not None and not bool(mask.bool().all()):
            raise ValueError(
                "UlyssesSPDataLoaderAdapter: attention_mask with padding is not supported; pack "
                "samples and mark them with position_ids instead"
            )
        if "position_ids" not in batch:
            batch["position_ids"] = torch.arange(seq).expand(bs, seq)
        if "labels" in batch and "shift_labels" not in batch:
            labels = batch["labels"]
            batch["shift_labels"] = torch.nn.functional.pad(labels[..., 1:], (0, 1), value=-100)
        chunk = seq // self.sp_world_size
        lo, hi = self.sp_rank * chunk, (self.sp_rank + 1) * chunk
        out = {}
        for key, value in batch.items():
            if torch.is_tensor(value) and value.dim() >= 2 and value.size(1) == seq:
                value = value[:, lo:hi]
            out[key] = value.contiguous().to(self.device) if torch.is_tensor(value) else value
        return out
