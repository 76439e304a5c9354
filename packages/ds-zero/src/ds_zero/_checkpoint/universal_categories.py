"""How `universal_checkpoint_info` says a parameter's tensor-parallel slices go back together.

[Note: merging tensor-parallel slices] A tensor-parallel checkpoint (several `mp_rank` files, no pipeline
layer files) holds, per tensor-parallel rank, the ZeRO partitions of that rank's slices. Each slice is
rebuilt from its rank's partitions, then the slices of one parameter are merged by the category its
name falls in (a regex list of the checkpoint's `universal_checkpoint_info`, as DeepSpeed 0.19.8 names them):

* `tp_replicated_parameter_patterns`: every rank holds the whole parameter; the slices must be equal and
  rank 0's is written (`{"param": ...}`, no `cat_dim`).
* `parameter_to_average_patterns`: the mean of the slices.
* `parameter_with_2_sub_params_cat_dim_0`: two sub-parameters stacked along dim 0, each cut on its own.
* `parameter_with_row_parallelism_patterns`: cut along dim 1 (`cat_dim` 1).
* anything else: cut along dim 0 (`cat_dim` 0), the column-parallel default.
* `vocabulary_parameter_patterns` (besides the above): the padding rows beyond `original_vocab_size` are
  dropped (`vocab_tensor`).
* a parameter with an `affine_map` entry (DeepSpeed's AutoTP writes one per parameter besides the
  categories): rebuilt from the map's pieces (`affine_map.py`), written as `{"param": ...}` (and
  `vocab_tensor`), its category patterns counted as used, as DeepSpeed's converter does.

A slice's shape is its own rank's (the `param_shapes` of that rank's model-states file), so uneven cuts
merge as they were made. With one rank (no tensor parallelism) every category is that one slice. The
same rules apply to the fp32 value and to every optimizer state. Fused projections described by their
sections (`parameter_with_sub_params`, no `affine_map`) merge section by section (`sub_param_merge.py`),
after the categories above and before the default, in DeepSpeed's order; their payload records the
sections as `sub_param_shape` (a dict of DeepSpeed's `SubparamShape` fields).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ds_zero._checkpoint.affine_map import AFFINE_MAP_KEY, AffineMaps, rebuild
from ds_zero._checkpoint.sub_param_merge import UniversalMergeError, merge_sub_params

__all__ = ["UNIVERSAL_INFO_KEY", "Categories"]

UNIVERSAL_INFO_KEY = "universal_checkpoint_info"
_REPLICATED = "tp_replicated_parameter_patterns"
_AVERAGE = "parameter_to_average_patterns"
_ROW_PARALLEL = "parameter_with_row_parallelism_patterns"
_VOCABULARY = "vocabulary_parameter_patterns"
_TWO_SUB_PARAMS = "parameter_with_2_sub_params_cat_dim_0"
_SUB_PARAMS = "parameter_with_sub_params"
_UNSUPPORTED_AUTOTP = "autotp_unsupported_parameter_patterns"
_SUB_PARAM_SHARD_WIDTHS = "sub_param_shard_widths"
_VERSION = "universal_checkpoint_version"
_CATEGORIES = (_REPLICATED, _AVERAGE, _ROW_PARALLEL, _VOCABULARY, _TWO_SUB_PARAMS)


class Categories:
    """The parameter categories of `universal_checkpoint_info`, and which of their patterns were used.

    Raises:
        ValueError: parameters the saving AutoTP marked unconvertible (names them), or an affine map
            version newer than this reader.
    """

    def __init__(self, info: Mapping[str, Any]) -> None:
        if info.get(_UNSUPPORTED_AUTOTP):
            details = ", ".join(f"{p}: {why}" for p, why in sorted(dict(info[_UNSUPPORTED_AUTOTP]).items()))
            raise ValueError(f"the saving AutoTP marked parameters it cannot convert to universal: {details}")
        self.info = info
        self.maps = AffineMaps(info.get(AFFINE_MAP_KEY))
        self.sub_params = [p for entry in info.get(_SUB_PARAMS) or [] for p in entry["patterns"]]
        self.unused = {p for key in _CATEGORIES for p in info.get(key, [])} | set(self.sub_params)

    def _match(self, key: str, name: str) -> bool:
        hits = [p for p in self.info.get(key, []) if re.match(p, name)]
        if len(hits) > 1:
            raise ValueError(f"parameter {name!r} matches several {key} patterns: {hits}")
        self.unused.difference_update(hits)
        return bool(hits)

    def payload(self, name: str, slices: Sequence[torch.Tensor], state: str = "fp32") -> dict[str, Any]:
        """The `{cat_dim?, param_n_sub_params?, sub_param_shape?, vocab_tensor?, param}` dict of a stage-1/2 state file.

        Args:
            name: the parameter.
            slices: its slice on every tensor-parallel rank (rank order), each of that rank's shape.
            state: which tensor this is (`fp32`, `exp_avg`, ...), for error messages.

        Raises:
            ValueError: a replicated parameter whose ranks hold different values (names it and the ranks),
                slices its affine map does not describe, or a fused projection whose recorded sections do
                not fit its slices (`UniversalMergeError`, also an AssertionError).
        """
        out: dict[str, Any] = {}
        amap = self.maps.find(name)
        sub_params = [p for p in self.sub_params if re.match(p, name)]
        self.unused.difference_update(sub_params[:1])
        if amap is not None:  # the map places every element; the categories it supersedes count as used
            for key in _CATEGORIES:
                self._match(key, name)
            full = rebuild(amap, slices, name, state)
        elif self._match(_REPLICATED, name):
            for rank, other in enumerate(slices[1:], start=1):
                if not torch.equal(slices[0], other):
                    raise UniversalMergeError(
                        f"parameter {name!r} is tensor-parallel replicated, but its {state} differs between "
                        f"tensor-parallel ranks 0 and {rank}: the checkpoint is inconsistent"
                    )
            full = slices[0]
        elif self._match(_AVERAGE, name):
            full = sum(slices[1:], slices[0]) / len(slices)
        elif self._match(_TWO_SUB_PARAMS, name):
            halves = [s.chunk(2, dim=0) for s in slices]
            full = torch.cat([torch.cat([h[i] for h in halves], dim=0) for i in (0, 1)], dim=0)
            out["cat_dim"] = 0
            out["param_n_sub_params"] = 2
        elif sub_params:
            entry = next(e for e in self.info[_SUB_PARAMS] if sub_params[0] in e["patterns"])
            widths = self.info.get(_SUB_PARAM_SHARD_WIDTHS) or {}
            version = float(self.info.get(_VERSION, 0.0))
            full, out["sub_param_shape"] = merge_sub_params(entry, sub_params[0], widths, version, slices, name)
        else:
            out["cat_dim"] = 1 if self._match(_ROW_PARALLEL, name) else 0
            full = slices[0] if len(slices) == 1 else torch.cat(list(slices), dim=out["cat_dim"])
        if self._match(_VOCABULARY, name):
            full = full[: int(self.info["original_vocab_size"]), :]
            out["vocab_tensor"] = True
        out["param"] = full
        return out
