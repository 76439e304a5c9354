"""`data_efficiency.data_routing`: random layerwise token dropping (random-LTD), validated before any work starts.

With `random_ltd.enabled` the engine builds a `RandomLTDScheduler` from this section and
`random_ltd_initialize()` (or `convert_to_random_ltd`) wires the model's wrapped layers to it; every
setting those need is checked here, named by its key path, when the switch is on. Off, the settings
are accepted and unused, as in DeepSpeed. `data_routing.enabled` and `data_efficiency.enabled` are
only reported back (`engine.data_efficiency_enabled()`): DeepSpeed acts on `random_ltd.enabled` alone.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import model_validator

from ds_comm import ConfigModel

__all__ = ["DataRoutingConfig", "LayerTokenLrSchedule", "RandomLtdConfig", "RandomLtdSchedule", "RandomLtdSteps"]

_PATH = "data_efficiency.data_routing.random_ltd"


class RandomLtdSteps(ConfigModel):
    """`random_ltd.random_ltd_schedule.schedule_config`."""

    require_steps: int
    """Steps over which the kept length grows from min_value to max_value."""
    seq_per_step: int
    """The kept length is a multiple of this."""

    @model_validator(mode="after")
    def _positive(self) -> RandomLtdSteps:
        for key in ("require_steps", "seq_per_step"):
            if getattr(self, key) <= 0:
                raise ValueError(f"{key} must be > 0, got {getattr(self, key)}")
        return self


class RandomLtdSchedule(ConfigModel):
    """`random_ltd.random_ltd_schedule`: the kept sequence length over steps."""

    min_value: int
    """Tokens kept at step 0."""
    max_value: int
    """Tokens kept at the end (the full sequence length: from then on no token is dropped)."""
    schedule_type: Literal["fixed_linear"] = "fixed_linear"
    """The one schedule DeepSpeed 0.19.8 implements."""
    schedule_config: RandomLtdSteps

    @model_validator(mode="after")
    def _ordered(self) -> RandomLtdSchedule:
        if not 0 < self.min_value <= self.max_value:
            raise ValueError(
                f"need 0 < min_value <= max_value, got min_value={self.min_value}, max_value={self.max_value}"
            )
        return self


class LayerTokenLrSchedule(ConfigModel):
    """`random_ltd.layer_token_lr_schedule`: an lr schedule over consumed layer-tokens (not implemented)."""

    inert_keys: ClassVar[dict[str, str]] = {
        "enabled": "the layer-token lr schedule is not implemented (DeepSpeed 0.19.8 raises NotImplementedError too)"
    }

    enabled: bool = False
    total_layer_tokens: int | None = None
    warmup_type: str | None = None
    warmup_layer_tokens: int | None = None


class RandomLtdConfig(ConfigModel):
    """`data_efficiency.data_routing.random_ltd` (random layerwise token dropping)."""

    enabled: bool = False
    """Build the random-LTD scheduler and step it at every training forward."""
    total_layer_num: int | None = None
    """Layers in the model (for the consumed layer-token count)."""
    random_ltd_layer_num: int | None = None
    """How many layers drop tokens; must equal the length of random_ltd_layer_id."""
    random_ltd_layer_id: list[int] | None = None
    """Indices of the layers that drop tokens (their `RandomLayerTokenDrop` wrappers, in model order)."""
    model_mask_name: str | None = None
    """The keyword the model passes its attention mask to each layer under (cut to the kept tokens); null: none."""
    model_type: Literal["encoder", "decoder"] | None = None
    """decoder: causal mask (its top-left block); encoder: padding mask gathered per layer (needs model_mask_name)."""
    hidden_state_order: Literal["batch_seq_dim", "seq_batch_dim"] | None = None
    """The layout of the hidden states the layers take: [batch, seq, hidden] or [seq, batch, hidden]."""
    random_ltd_schedule: RandomLtdSchedule | None = None
    layer_token_lr_schedule: LayerTokenLrSchedule = LayerTokenLrSchedule()

    @model_validator(mode="after")
    def _complete_when_enabled(self) -> RandomLtdConfig:
        if not self.enabled:
            return self
        needed = (
            "total_layer_num",
            "random_ltd_layer_num",
            "random_ltd_layer_id",
            "model_type",
            "hidden_state_order",
            "random_ltd_schedule",
        )
        missing = [key for key in needed if getattr(self, key) is None]
        if missing:
            raise ValueError(f"random-LTD is enabled but {', '.join(missing)} is not set")
        ids, total, num = self.random_ltd_layer_id, self.total_layer_num, self.random_ltd_layer_num
        assert ids is not None and total is not None and num is not None
        if total <= 0:
            raise ValueError(f"total_layer_num must be > 0, got {total}")
        if num != len(ids):
            raise ValueError(f"random_ltd_layer_num={num} must equal the length of random_ltd_layer_id {ids}")
        if len(set(ids)) != len(ids) or any(not 0 <= i < total for i in ids):
            raise ValueError(
                f"random_ltd_layer_id {ids} must be distinct layer indices in 0..{total - 1} (total_layer_num)"
            )
        if self.model_type == "encoder" and self.model_mask_name is None:
            raise ValueError("model_type 'encoder' needs model_mask_name (its padding mask is gathered per layer)")
        return self


class DataRoutingConfig(ConfigModel):
    """`data_efficiency.data_routing`."""

    enabled: bool = False
    """Reported by the engine only; random_ltd.enabled is the switch that acts (as in DeepSpeed)."""
    random_ltd: RandomLtdConfig = RandomLtdConfig()
