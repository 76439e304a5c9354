"""`TiledLinear`: a linear layer cut into a grid of smaller linears, so ZeRO-3 gathers one tile at a time.

Stage 3 gathers a module's whole weight when the module runs. For a huge `nn.Linear` (a vocabulary
projection) that one gather can be the peak of the step. `TiledLinear(in, out, in_splits=a,
out_splits=b)` holds `b` rows of `a` linears, tile `(r, c)` mapping input columns `c` to output rows
`r`; each tile is its own module, so only one tile's weight is gathered at a time (plus prefetch). The
result is `nn.Linear`'s: output block `r` is the sum over `c` of tile `(r, c)` applied to input chunk `c`,
and the bias of output block `r` lives on its last tile. Chunk sizes follow DeepSpeed's uniform split
(the first `n % k` chunks one larger), so the module layout and state-dict keys match DeepSpeed's
`deepspeed.runtime.zero.tiling.TiledLinear`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ds_zero._params.gathered_parameters import GatheredParameters

__all__ = ["TiledLinear", "TiledLinearReturnBias", "split_tensor_along_last_dim", "uniform_bounds"]


def uniform_bounds(num_items: int, num_parts: int) -> list[int]:
    """`num_parts + 1` boundaries cutting `num_items` into near-equal chunks, the first `num_items % num_parts`
    one larger (with fewer items than parts, the last parts are empty)."""
    if num_items <= num_parts:
        return [min(p, num_items) for p in range(num_parts + 1)]
    chunk, extra = divmod(num_items, num_parts)
    return [p * chunk + min(p, extra) for p in range(num_parts + 1)]


def split_tensor_along_last_dim(
    tensor: torch.Tensor, partitions: Sequence[int], contiguous_split_chunks: bool = False
) -> tuple[torch.Tensor, ...]:
    """`tensor` split along its last dimension into chunks of the sizes in `partitions`."""
    chunks = torch.split(tensor, list(partitions), dim=tensor.dim() - 1)
    return tuple(c.contiguous() for c in chunks) if contiguous_split_chunks else tuple(chunks)


class TiledLinear(nn.Module):
    """A drop-in for `nn.Linear(in_features, out_features, bias)` made of `out_splits x in_splits` tiles.

    Args:
        in_features: input features.
        out_features: output features.
        bias: add a bias (held by the last tile of each output block).
        in_splits: tiles along the input dimension (1 to `in_features`).
        out_splits: tiles along the output dimension (1 to `out_features`).
        input_is_already_split: `forward` receives a sequence of `in_splits` input chunks.
        combine_out_splits: concatenate the output blocks (False: return the list of blocks).
        linear_cls: the class of each tile (`nn.Linear` or one with its signature).
        init_linear: copy the weight and bias of this `nn.Linear` (see `copy_params_from`).
        **kwargs: more arguments for `linear_cls` (`dtype=`, `device=`...).

    Raises:
        RuntimeError: `in_splits` or `out_splits` outside `[1, features]` (DeepSpeed's error type).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        in_splits: int = 1,
        out_splits: int = 1,
        input_is_already_split: bool = False,
        combine_out_splits: bool = True,
        linear_cls: type[nn.Module] = nn.Linear,
        init_linear: nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if not 1 <= in_splits <= in_features:
            raise RuntimeError(f"TiledLinear: in_splits={in_splits} must be in [1, in_features={in_features}]")
        if not 1 <= out_splits <= out_features:
            raise RuntimeError(f"TiledLinear: out_splits={out_splits} must be in [1, out_features={out_features}]")
        self.in_features = in_features
        self.out_features = out_features
        self.use_bias = bias
        self.in_splits = in_splits
        self.out_splits = out_splits
        self.input_is_already_split = input_is_already_split
        self.combine_out_splits = combine_out_splits
        self.in_parts = uniform_bounds(in_features, in_splits)
        self.out_parts = uniform_bounds(out_features, out_splits)
        self.linears = nn.ModuleList()
        for r in range(out_splits):
            row = nn.ModuleList()
            rows = self.out_parts[r + 1] - self.out_parts[r]
            for c in range(in_splits):
                cols = self.in_parts[c + 1] - self.in_parts[c]
                row.append(linear_cls(cols, rows, bias=bias and c == in_splits - 1, **kwargs))
            self.linears.append(row)
        if init_linear is not None:
            self.copy_params_from(init_linear)

    def forward(self, input_: Any) -> Any:
        if self.in_splits == 1:
            inputs = [input_]
        elif self.input_is_already_split:
            inputs = list(input_)
            if len(inputs) != self.in_splits:
                raise ValueError(f"TiledLinear: got {len(inputs)} input chunks, expected in_splits={self.in_splits}")
        else:
            bounds = uniform_bounds(input_.shape[-1], self.in_splits)
            inputs = list(self._split_global_input(input_, [bounds[i + 1] - bounds[i] for i in range(self.in_splits)]))
        outputs = []
        for r in range(self.out_splits):
            out = None
            for c in range(self.in_splits):
                out = self._reduce_local_output(c, r, out, self.linears[r][c](inputs[c]))
            outputs.append(out)
        return self._combine_output_splits(outputs) if self.combine_out_splits else outputs

    def _split_global_input(self, input_: Any, split_sizes: list[int]) -> Sequence[Any]:
        """The input cut along its last dimension (override for other input types)."""
        return split_tensor_along_last_dim(input_, split_sizes)

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        """Add one tile's output into its output block (override for other output types)."""
        return new_out.clone() if current_out is None else current_out + new_out

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        """Join the output blocks (override for other output types)."""
        return torch.cat(outputs, dim=-1)

    @torch.no_grad()
    def copy_params_from(self, other: nn.Module) -> None:
        """Copy the weight and bias of the linear `other` into the tiles.

        Under ZeRO-3 this is a collective: each tile is gathered, rank 0's copy is kept on every rank.

        Raises:
            ValueError: `other`'s weight or bias does not match this layer's shape.
        """
        weight = getattr(other, "weight", None)
        if weight is None or tuple(weight.shape) != (self.out_features, self.in_features):
            shape = None if weight is None else tuple(weight.shape)
            raise ValueError(
                f"copy_params_from: need a weight of shape {(self.out_features, self.in_features)}, got {shape}"
            )
        other_bias = getattr(other, "bias", None)
        if self.use_bias != (other_bias is not None) or (
            other_bias is not None and tuple(other_bias.shape) != (self.out_features,)
        ):
            raise ValueError(
                f"copy_params_from: this layer has {'a' if self.use_bias else 'no'} bias ({self.out_features} "
                f"features); the source's bias is {None if other_bias is None else tuple(other_bias.shape)}"
            )
        for r in range(self.out_splits):
            r0, r1 = self.out_parts[r], self.out_parts[r + 1]
            for c in range(self.in_splits):
                c0, c1 = self.in_parts[c], self.in_parts[c + 1]
                tile = self.linears[r][c]
                with GatheredParameters(tile.weight, modifier_rank=0):
                    tile.weight.copy_(weight[r0:r1, c0:c1])
                if tile.bias is not None:
                    with GatheredParameters(tile.bias, modifier_rank=0):
                        tile.bias.copy_(other_bias[r0:r1])


class TiledLinearReturnBias(TiledLinear):
    """`TiledLinear` over tiles that return `(output, bias)` (Megatron-style linears that leave the bias add
    to the caller): outputs are summed, the blocks' biases are concatenated (None when no tile has one)."""

    def _reduce_local_output(self, in_id: int, out_id: int, current_out: Any, new_out: Any) -> Any:
        if not (isinstance(new_out, tuple) and len(new_out) == 2):
            raise TypeError("TiledLinearReturnBias: each tile must return (output, bias)")
        old, old_bias = current_out if current_out is not None else (None, None)
        tensor, bias = new_out
        return super()._reduce_local_output(in_id, out_id, old, tensor), (old_bias if bias is None else bias)

    def _combine_output_splits(self, outputs: list[Any]) -> Any:
        tensor = super()._combine_output_splits([o[0] for o in outputs])
        biases = [o[1] for o in outputs if o[1] is not None]
        return tensor, (super()._combine_output_splits(biases) if biases else None)
