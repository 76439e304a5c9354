"""DeepSpeed's reference random-LTD gather/scatter for `[batch, seq, hidden]` decoder states, a sequence at a time.

`bsh_decoder_gather` keeps `reserved_length` random positions per sequence (sorted) and cuts the causal
mask to them; `bsh_decoder_scatter` writes the kept tokens' new states back in place. The batched,
autograd-aware versions the random-LTD layer uses are in `token_ops`.
"""

from __future__ import annotations

import torch

__all__ = ["bsh_decoder_gather", "bsh_decoder_scatter"]


def bsh_decoder_gather(
    reserved_length: int, hidden_states: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """(kept states `[batch, reserved, hidden]`, per-sequence sorted positions, mask `[..., reserved, reserved]`)."""
    positions = [
        torch.randperm(hidden_states.size(1), device=hidden_states.device)[:reserved_length].sort().values
        for _ in range(hidden_states.size(0))
    ]
    kept = torch.stack([hidden_states[row, where, :] for row, where in enumerate(positions)])
    return kept, positions, mask[:, :, :reserved_length, :reserved_length]


def bsh_decoder_scatter(
    hidden_states: torch.Tensor, part_hidden_states: torch.Tensor, rand_list: list[torch.Tensor]
) -> torch.Tensor:
    """Write `part_hidden_states` back at `rand_list`'s positions of `hidden_states` (in place); returns it."""
    for row, where in enumerate(rand_list):
        hidden_states[row, where, :] = part_hidden_states[row]
    return hidden_states
