"""Configurable AutoTP: which layers to cut, and how, given as regex specs (`tensor_parallel.partition_config`).

DeepSpeed 0.19.8's `AutoTPConfig` / `TPLayerSpec`: a list of layer specs, each a set of regexes matched
(with `re.match`) against a parameter name (`<module path>.weight`) and what to do with the layers
they match: `column` (output features cut), `row` (input features cut, outputs summed) or `skip`
(left whole). A spec may view a fused weight as sub-parameters (`shape`, `partition_dim`: `(3, -1)` is
three equal parts, `((q, k, v), -1)` three given sizes) so each is cut on its own, gather a column cut's
output back to full width (`gather_output`), or, for a skipped parameter that sees sharded activations,
sum its gradient over the group (`grad_allreduce`). `model_types` limits a spec to models whose
`config.model_type` is listed. The first matching spec wins; a layer no spec matches stays whole
(`strict_mode`: an error instead).

`preset_model` names one of DeepSpeed's built-in spec lists (`AutoTPPresets`); with `use_default_specs`
(the default) a `partition_config` is laid over the preset (its specs first), otherwise it replaces it.

Every malformed entry is refused when the config is read, with its key path
(`tensor_parallel.partition_config.layer_specs[1].partition_type`), before any layer is touched.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

__all__ = [
    "AutoTPConfig",
    "AutoTPPresets",
    "PartitionType",
    "TPLayerSpec",
    "merge_autotp_configs",
    "model_type_of",
    "partition_config_from_settings",
]

logger = logging.getLogger(__name__)

_WHERE = "tensor_parallel.partition_config"
_SPEC_KEYS = ("patterns", "partition_type", "shape", "partition_dim", "model_types", "gather_output", "grad_allreduce")
_CONFIG_KEYS = (
    "tp_size",
    "layer_specs",
    "embedding_partition_dim",
    "lm_head_patterns",
    "use_default_specs",
    "strict_mode",
)


class PartitionType(enum.Enum):
    """How a matched layer is cut."""

    COLUMN = "column"
    ROW = "row"
    SKIP = "skip"


def _as_tuple(value: Any) -> Any:
    return tuple(_as_tuple(v) for v in value) if isinstance(value, (list, tuple)) else value


@dataclasses.dataclass
class TPLayerSpec:
    """One rule: the parameters its `patterns` match are cut as `partition_type` says."""

    patterns: list[str]
    partition_type: PartitionType = PartitionType.COLUMN
    shape: tuple[Any, ...] | None = None
    """A view of the weight naming sub-parameters at `partition_dim` (an int: that many equal parts; a
    tuple of ints: their sizes; -1: inferred)."""
    partition_dim: int | None = None
    """The cut dim of the view (default: 0 for column, 1 for row)."""
    model_types: list[str] | None = None
    gather_output: bool = False
    grad_allreduce: bool = False
    where: str = dataclasses.field(default=f"{_WHERE}.layer_specs[?]", compare=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.partition_type, str):
            try:
                self.partition_type = PartitionType(self.partition_type.lower())
            except ValueError:
                raise ValueError(
                    f"{self.where}.partition_type: {self.partition_type!r} is not one of "
                    f"{', '.join(t.value for t in PartitionType)}"
                ) from None
        if isinstance(self.patterns, str) or not all(isinstance(p, str) for p in self.patterns):
            raise ValueError(f"{self.where}.patterns: a list of regex strings, got {self.patterns!r}")
        for pattern in self.patterns:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"{self.where}.patterns: {pattern!r} is not a valid regex ({err})") from None
        if self.shape is not None:
            self.shape = _as_tuple(self.shape)
            self._check_shape()
        if self.gather_output and self.partition_type is not PartitionType.COLUMN:
            raise ValueError(f"{self.where}.gather_output: only a column cut gathers its output")
        if self.gather_output and self.shape is not None:
            raise ValueError(f"{self.where}.gather_output: not supported together with shape (sub-parameters)")
        if self.grad_allreduce and self.partition_type is not PartitionType.SKIP:
            raise ValueError(f"{self.where}.grad_allreduce: only a skip spec (a replicated parameter) takes it")

    def _check_shape(self) -> None:
        shape, dim = self.shape, self.get_partition_dim()
        if not isinstance(shape, tuple) or not shape:
            raise ValueError(f"{self.where}.shape: a list of ints (a list of sizes at the cut dim), got {shape!r}")
        if not 0 <= dim < len(shape):
            raise ValueError(f"{self.where}.partition_dim: {dim} is out of range for shape {list(shape)}")
        for i, entry in enumerate(shape):
            if isinstance(entry, tuple):
                if i != dim:
                    raise ValueError(f"{self.where}.shape: a list of sizes is allowed only at partition_dim={dim}")
                if not entry or any(isinstance(v, bool) or not isinstance(v, int) or v <= 0 for v in entry):
                    raise ValueError(f"{self.where}.shape: sub-parameter sizes {list(entry)} must be positive ints")
            elif isinstance(entry, bool) or not isinstance(entry, int) or entry == 0 or entry < -1:
                raise ValueError(f"{self.where}.shape: {entry!r} must be a positive int or -1")

    def get_partition_dim(self) -> int:
        """The cut dim: `partition_dim`, else 0 for a column cut and 1 for a row cut."""
        if self.partition_dim is not None:
            return self.partition_dim
        return 0 if self.partition_type is PartitionType.COLUMN else 1

    def get_sub_param_sizes(self) -> tuple[int, ...] | None:
        """The sizes listed at the cut dim, when the shape lists them."""
        if self.shape is None:
            return None
        entry = self.shape[self.get_partition_dim()]
        return entry if isinstance(entry, tuple) else None

    def get_num_sub_params(self) -> int | None:
        """How many sub-parameters the shape names at the cut dim (None: not said)."""
        if self.shape is None:
            return None
        entry = self.shape[self.get_partition_dim()]
        if isinstance(entry, tuple):
            return len(entry)
        return entry if entry > 0 else None

    def has_unequal_sub_params(self) -> bool:
        return self.get_sub_param_sizes() is not None

    def matches(self, param_name: str, model_type: str | None = None) -> bool:
        """Whether this spec applies to `param_name` in a model of `model_type`."""
        if self.model_types:
            if model_type is None or str(model_type).lower() not in {str(t).lower() for t in self.model_types}:
                return False
        return any(re.match(p, param_name) for p in self.patterns)

    @classmethod
    def from_dict(cls, entry: Mapping[str, Any], where: str) -> TPLayerSpec:
        """A spec from its JSON form; unknown keys are refused with their path."""
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where}: each layer spec is an object, got {entry!r}")
        unknown = sorted(set(entry) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(_SPEC_KEYS)}")
        if not entry.get("patterns"):
            raise ValueError(f"{where}.patterns: required (a non-empty list of regexes)")
        patterns = entry["patterns"]
        return cls(
            patterns=[patterns] if isinstance(patterns, str) else list(patterns),
            partition_type=entry.get("partition_type", "column"),
            shape=entry.get("shape"),
            partition_dim=entry.get("partition_dim"),
            model_types=entry.get("model_types"),
            gather_output=bool(entry.get("gather_output", False)),
            grad_allreduce=bool(entry.get("grad_allreduce", False)),
            where=where,
        )


@dataclasses.dataclass
class AutoTPConfig:
    """An ordered list of layer specs and how unmatched layers are treated."""

    tp_size: int = 1
    layer_specs: list[TPLayerSpec] = dataclasses.field(default_factory=list)
    embedding_partition_dim: int = 1
    """Recorded for DeepSpeed's schema; embeddings stay whole in ds."""
    lm_head_patterns: list[str] = dataclasses.field(default_factory=lambda: ["lm_head", "embed_out"])
    use_default_specs: bool = True
    """Lay these specs over the preset's (`preset_model`) instead of replacing them."""
    strict_mode: bool = False
    """A layer no spec matches is an error instead of staying whole."""

    def find_matching_spec(self, param_name: str, model_type: str | None = None) -> TPLayerSpec | None:
        """The first spec matching `param_name` (a later match is logged and ignored)."""
        hits = [spec for spec in self.layer_specs if spec.matches(param_name, model_type)]
        if len(hits) > 1:
            logger.debug("AutoTP: %s matches %d layer specs; the first wins", param_name, len(hits))
        return hits[0] if hits else None

    @classmethod
    def from_dict(cls, config: Mapping[str, Any], where: str = _WHERE) -> AutoTPConfig:
        """The config from its JSON form (`tensor_parallel.partition_config`); errors name the key path."""
        if not isinstance(config, Mapping):
            raise ValueError(f"{where}: an object with layer_specs, got {config!r}")
        unknown = sorted(set(config) - set(_CONFIG_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; valid: {', '.join(_CONFIG_KEYS)}")
        specs = config.get("layer_specs", [])
        if not isinstance(specs, list):
            raise ValueError(f"{where}.layer_specs: a list of layer specs, got {specs!r}")
        return cls(
            tp_size=int(config.get("tp_size", 1)),
            layer_specs=[TPLayerSpec.from_dict(s, f"{where}.layer_specs[{i}]") for i, s in enumerate(specs)],
            embedding_partition_dim=int(config.get("embedding_partition_dim", 1)),
            lm_head_patterns=list(config.get("lm_head_patterns", ["lm_head", "embed_out"])),
            use_default_specs=bool(config.get("use_default_specs", True)),
            strict_mode=bool(config.get("strict_mode", False)),
        )


def merge_autotp_configs(base: AutoTPConfig, override: AutoTPConfig) -> AutoTPConfig:
    """`override`'s specs ahead of `base`'s; `override`'s flags."""
    return AutoTPConfig(
        tp_size=override.tp_size if override.tp_size > 1 else base.tp_size,
        layer_specs=[*override.layer_specs, *base.layer_specs],
        embedding_partition_dim=override.embedding_partition_dim,
        lm_head_patterns=override.lm_head_patterns or base.lm_head_patterns,
        use_default_specs=override.use_default_specs,
        strict_mode=override.strict_mode,
    )


def _spec(patterns: str, kind: str, shape: Any = None, partition_dim: int | None = None) -> TPLayerSpec:
    return TPLayerSpec([patterns], PartitionType(kind), shape=shape, partition_dim=partition_dim, where="preset")


def _attention_mlp(attn: str, qkv: str, mlp_down: str, mlp_up: str) -> list[TPLayerSpec]:
    return [_spec(attn, "row"), _spec(qkv, "column"), _spec(mlp_down, "row"), _spec(mlp_up, "column")]


class AutoTPPresets:
    """DeepSpeed's built-in spec lists for common architectures (`preset_model`)."""

    @staticmethod
    def llama() -> AutoTPConfig:
        return AutoTPConfig(
            layer_specs=_attention_mlp(
                r".*\.self_attn\.o_proj\.weight$",
                r".*\.self_attn\.[qkv]_proj\.weight$",
                r".*\.mlp\.down_proj\.weight$",
                r".*\.mlp\.(up|gate)_proj\.weight$",
            )
        )

    @staticmethod
    def llama_gqa(num_heads: int, num_kv_heads: int, head_dim: int) -> AutoTPConfig:
        """Llama with a fused, grouped-query qkv projection (unequal q/k/v sizes)."""
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        specs = AutoTPPresets.llama().layer_specs
        specs[1] = _spec(r".*\.self_attn\.qkv_proj\.weight$", "column", shape=((q, kv, kv), -1), partition_dim=0)
        return AutoTPConfig(layer_specs=specs)

    @staticmethod
    def qwen2() -> AutoTPConfig:
        return AutoTPPresets.llama()

    @staticmethod
    def bloom() -> AutoTPConfig:
        return AutoTPConfig(
            layer_specs=_attention_mlp(
                r".*\.self_attention\.dense\.weight$",
                r".*\.self_attention\.query_key_value\.weight$",
                r".*\.mlp\.dense_4h_to_h\.weight$",
                r".*\.mlp\.dense_h_to_4h\.weight$",
            )
        )

    @staticmethod
    def chatglm() -> AutoTPConfig:
        return AutoTPConfig(
            layer_specs=[
                _spec(r".*\.self_attention\.dense\.weight$", "row"),
                _spec(r".*\.self_attention\.query_key_value\.weight$", "column", shape=(3, -1), partition_dim=0),
                _spec(r".*\.mlp\.dense_4h_to_h\.weight$", "row"),
                _spec(r".*\.mlp\.dense_h_to_4h\.weight$", "column", shape=(2, -1), partition_dim=0),
            ]
        )

    @staticmethod
    def phi3() -> AutoTPConfig:
        return AutoTPConfig(
            layer_specs=[
                _spec(r".*\.self_attn\.o_proj\.weight$", "row"),
                _spec(r".*\.self_attn\.qkv_proj\.weight$", "column", shape=(3, -1), partition_dim=0),
                _spec(r".*\.mlp\.down_proj\.weight$", "row"),
                _spec(r".*\.mlp\.gate_up_proj\.weight$", "column", shape=(2, -1), partition_dim=0),
            ]
        )

    @staticmethod
    def mixtral() -> AutoTPConfig:
        return AutoTPConfig(
            layer_specs=[
                _spec(r".*\.self_attn\.o_proj\.weight$", "row"),
                _spec(r".*\.self_attn\.[qkv]_proj\.weight$", "column"),
                _spec(r".*\.block_sparse_moe\.experts\.\d+\.w2\.weight$", "row"),
                _spec(r".*\.block_sparse_moe\.experts\.\d+\.w[13]\.weight$", "column"),
                _spec(r".*\.block_sparse_moe\.gate\.weight$", "skip"),
            ]
        )

    @staticmethod
    def deepseek_v2() -> AutoTPConfig:
        return AutoTPConfig(
            layer_specs=[
                _spec(r".*\.self_attn\.o_proj\.weight$", "row"),
                _spec(r".*\.self_attn\.(q_a_proj|kv_a_proj_with_mqa)\.weight$", "skip"),
                _spec(r".*\.self_attn\.(q_b_proj|kv_b_proj)\.weight$", "column"),
                _spec(r".*\.mlp\.experts\.\d+\.down_proj\.weight$", "row"),
                _spec(r".*\.mlp\.experts\.\d+\.(up|gate)_proj\.weight$", "column"),
                _spec(r".*\.mlp\.gate\.weight$", "skip"),
                _spec(r".*\.mlp\.shared_experts\.down_proj\.weight$", "row"),
                _spec(r".*\.mlp\.shared_experts\.(up|gate)_proj\.weight$", "column"),
            ]
        )

    @staticmethod
    def get_preset(model_type: str) -> AutoTPConfig | None:
        """The preset named `model_type` (case-insensitive), None when there is none."""
        maker = PRESETS.get(model_type.lower())
        return maker() if maker is not None else None


#: `preset_model` names and the spec lists they stand for.
PRESETS: Mapping[str, Callable[[], AutoTPConfig]] = {
    "llama": AutoTPPresets.llama,
    "bloom": AutoTPPresets.bloom,
    "chatglm": AutoTPPresets.chatglm,
    "mixtral": AutoTPPresets.mixtral,
    "deepseek_v2": AutoTPPresets.deepseek_v2,
    "qwen2": AutoTPPresets.qwen2,
    "phi3": AutoTPPresets.phi3,
}


def partition_config_from_settings(
    partition_config: Mapping[str, Any] | None, preset_model: str | None, tp_size: int = 1
) -> AutoTPConfig | None:
    """What `tensor_parallel.partition_config` and `preset_model` together ask for (None: neither is set).

    Raises:
        ValueError: an unknown preset, or a malformed partition_config (the message names the key path).
    """
    config = None
    if preset_model:
        config = AutoTPPresets.get_preset(preset_model)
        if config is None:
            raise ValueError(f"tensor_parallel.preset_model: {preset_model!r} is not one of {', '.join(PRESETS)}")
    if partition_config:
        custom = AutoTPConfig.from_dict(partition_config)
        config = merge_autotp_configs(config, custom) if config is not None and custom.use_default_specs else custom
    if config is not None:
        config.tp_size = tp_size
    return config


def model_type_of(model: nn.Module) -> str | None:
    """`model.config.model_type` (lower case), else a guess from the model's class name (`LlamaDecoderLayer`:
    "llama"), as DeepSpeed guesses it; None when neither says."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type:
        return str(model_type).lower()
    match = re.match(r"(\w+?)(DecoderLayer|Block|Layer)$", type(model).__name__)
    return match.group(1).lower() if match else None
