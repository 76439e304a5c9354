"""Sequence parallelism (`deepspeed.sequence`): DeepSpeed-Ulysses `DistributedAttention` and its all-to-all,
and the FPDT (the sequence in chunks, kept in host memory), AutoSP
(multimodal models: ViT attention and the vision-language fusion), the
losses over vocabulary- and sequence-sharded logits (vocabulary-parallel and fused linear cross
entropy, per-token log-probabilities / entropy / KL)."""

from __future__ import annotations

from ds_parallel.sequence._all_gather import all_gather_autograd
from ds_parallel.sequence._all_to_all import seq_all_to_all
from ds_parallel.sequence._auto_sp import auto_wrap_model_for_sp
from ds_parallel.sequence._autosp_detect import SPModelInfo, detect_model_sp_info
from ds_parallel.sequence._autosp_fusion import (
    InternVLFusionAdapter,
    LlavaFusionAdapter,
    ModalityFusionSPAdapter,
    Qwen2VLFusionAdapter,
)
from ds_parallel.sequence._autosp_vit import UlyssesSPViTAttention
from ds_parallel.sequence._cross_entropy import (
    VocabParallelCausalLMLoss,
    VocabParallelCrossEntropyLoss,
    configure_vocab_parallel_loss,
    validate_vocab_parallel_loss,
    vocab_parallel_cross_entropy,
    vocab_sequence_parallel_cross_entropy,
)
from ds_parallel.sequence._fpdt import FPDT_FFN, FPDT_Attention, FPDT_InputConstruct, FPDT_LogitsLoss, SequenceChunk
from ds_parallel.sequence._linear_cross_entropy import vocab_parallel_linear_cross_entropy
from ds_parallel.sequence._vocab_ops import vocab_parallel_entropy, vocab_parallel_kl_div, vocab_parallel_logprobs
from ds_parallel.sequence.layer import DistributedAttention, head_split_sizes

__all__ = [
    "InternVLFusionAdapter",
    "LlavaFusionAdapter",
    "ModalityFusionSPAdapter",
    "Qwen2VLFusionAdapter",
    "SPModelInfo",
    "UlyssesSPViTAttention",
    "auto_wrap_model_for_sp",
    "detect_model_sp_info",
    "FPDT_FFN",
    "FPDT_Attention",
    "FPDT_InputConstruct",
    "FPDT_LogitsLoss",
    "SequenceChunk",
    "DistributedAttention",
    "VocabParallelCausalLMLoss",
    "VocabParallelCrossEntropyLoss",
    "all_gather_autograd",
    "configure_vocab_parallel_loss",
    "head_split_sizes",
    "seq_all_to_all",
    "validate_vocab_parallel_loss",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_entropy",
    "vocab_parallel_kl_div",
    "vocab_parallel_linear_cross_entropy",
    "vocab_parallel_logprobs",
    "vocab_sequence_parallel_cross_entropy",
]
