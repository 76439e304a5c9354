"""`AutoEP`: DeepSpeed 0.19.8's two-step driver over ds's conversion: find the MoE blocks (`ep_parser`), then
replace them one by one (`replace_moe_layer`), each with the expert-parallel degree and rank given then.

`convert_moe_model` does both in one call; this object is the shape DeepSpeed's code and tests drive.
"""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed import ProcessGroup

from ds_parallel.autoep._convert import AutoEPOptions, _route_scale, detect_moe_layers
from ds_parallel.autoep._layer import AutoEPMoELayer, MoELayerSpec
from ds_parallel.autoep._replace import replace_moe_block
from ds_parallel.autoep._settings import AutoEPConfig, validate_autoep_post_detection

__all__ = ["AutoEP", "resolve_route_scale"]

logger = logging.getLogger(__name__)


def resolve_route_scale(config: AutoEPConfig | AutoEPOptions, model_config: object) -> float:
    """The routing-weight factor: `routed_scaling_factor` when set, else the model config's, else `route_scale`.

    Raises:
        ValueError: the value in use is not a finite number (names the key it came from).
    """
    opts = config.to_options() if isinstance(config, AutoEPConfig) else config
    return _route_scale(opts, model_config)


class AutoEP:
    """Detect and replace a model's MoE blocks under one `AutoEPConfig` (the model is changed in place)."""

    def __init__(self, model: nn.Module, config: AutoEPConfig) -> None:
        self.model = model
        self.config = config
        self.model_config = getattr(model, "config", None)
        self.preset_name: str | None = None

    def ep_parser(self) -> list[MoELayerSpec]:
        """The model's MoE blocks, resolved, after the per-block checks (`validate_autoep_post_detection`).

        Raises:
            ValueError: no block found, or a block that the configured degree or routing cannot serve.
        """
        self.preset_name, _, specs = detect_moe_layers(self.model, self.config.to_options())
        validate_autoep_post_detection(self.config, specs)
        return specs

    def replace_moe_layer(
        self, spec: MoELayerSpec, ep_size: int, ep_rank: int, ep_group: ProcessGroup | None = None
    ) -> AutoEPMoELayer:
        """Replace the block `spec` describes by its `AutoEPMoELayer` holding expert-parallel rank `ep_rank`'s
        experts (no collective; a layer with `ep_size` > 1 and no group binds it in `set_deepspeed_parallelism`)."""
        return replace_moe_block(self.model, spec, ep_size=ep_size, ep_rank=ep_rank, ep_group=ep_group)
