"""The rollout interface: what an RL/distillation trainer asks a generation backend for, and gets back.

A trainer hands `RolloutEngine.generate` a `RolloutRequest` (left-padded prompts) and a `SamplingConfig`,
and gets a `RolloutBatch`: prompt and response in one tensor, with the column where responses start, so
the loss can be taken over response tokens only. Shapes are checked at construction, so a backend that
returns a malformed batch fails where it builds it, not inside the loss.
"""

from __future__ import annotations

import abc
import dataclasses

import torch

__all__ = ["RolloutBatch", "RolloutConfig", "RolloutEngine", "RolloutRequest", "SamplingConfig"]


@dataclasses.dataclass
class RolloutConfig:
    """Which backend `build_rollout` makes (`engine`: "hybrid_engine") and its CUDA-graph switch."""

    engine: str = "hybrid_engine"
    use_graph_capture: bool = False


@dataclasses.dataclass
class SamplingConfig:
    """Per-call sampling: temperature <= 0 is greedy; top_k <= 0 and top_p = 1 disable those filters."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    n_samples_per_prompt: int = 1
    continuous_batch_size: int | None = None


@dataclasses.dataclass
class RolloutRequest:
    """Prompts `[B, T_p]`, left-padded (real tokens at the right edge), and their attention mask."""

    prompt_ids: torch.Tensor
    prompt_attention_mask: torch.Tensor

    def __post_init__(self) -> None:
        if self.prompt_ids.dim() != 2:
            raise ValueError(f"prompt_ids must be 2-D [B, T_p], got shape {tuple(self.prompt_ids.shape)}")
        if self.prompt_attention_mask.shape != self.prompt_ids.shape:
            raise ValueError(
                f"prompt_attention_mask shape {tuple(self.prompt_attention_mask.shape)} does not match "
                f"prompt_ids {tuple(self.prompt_ids.shape)}"
            )


@dataclasses.dataclass
class RolloutBatch:
    """Prompt + response per sample `[B', T]` (B' = B * n_samples_per_prompt), its mask, and where responses start."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_start_idx: torch.Tensor

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2:
            raise ValueError(f"input_ids must be 2-D [B', T], got shape {tuple(self.input_ids.shape)}")
        if self.attention_mask.shape != self.input_ids.shape:
            raise ValueError(
                f"attention_mask shape {tuple(self.attention_mask.shape)} does not match "
                f"input_ids {tuple(self.input_ids.shape)}"
            )
        rows = self.input_ids.shape[0]
        if tuple(self.response_start_idx.shape) != (rows,):
            raise ValueError(
                f"response_start_idx must be 1-D of length {rows}, got shape {tuple(self.response_start_idx.shape)}"
            )

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])


class RolloutEngine(abc.ABC):
    """A generation backend: `generate` a batch, `sync_weights` after training steps, `shutdown` at the end."""

    name: str = "base"

    @abc.abstractmethod
    def generate(self, request: RolloutRequest, sampling: SamplingConfig) -> RolloutBatch:
        """Prompts in, prompt + response out."""

    @abc.abstractmethod
    def sync_weights(self, step: int) -> None:
        """Make the backend generate with the trained weights of optimizer step `step`."""

    def shutdown(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release the backend's resources (nothing by default)."""
