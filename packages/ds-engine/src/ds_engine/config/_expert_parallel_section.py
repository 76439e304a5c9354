"""`expert_parallel`: AutoEP, DeepSpeed 0.19.8's keys, defaults and checks.

With `enabled`, initialize() replaces the model's MoE blocks by expert-parallel layers (ds-parallel's
`autoep`). Every key DeepSpeed reads is accepted; values are checked as DeepSpeed checks them, with the
key path in the message. What ds does not do is refused by name: DeepEP (`comm_backend="deepep"` and the
`row_weighting_impl="fused"` that needs it), folding expert tensor parallelism into AutoEP
(`expert_tensor_parallel_size` > 1) and expert-bias load balancing (`load_balance_coeff`, which DeepSpeed
refuses too). Kernel choices (`use_grouped_mm`, `combine_impl`, `async_split_plan`, ...) compute the same
function and have no effect in ds.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import model_validator

from ds_comm import ConfigModel

__all__ = ["ExpertParallelConfig"]

_NOT_IN_DS = "is not implemented in ds"
_DIRECT_NAMES = (
    "router_pattern",
    "expert_pattern",
    "expert_w1",
    "expert_w2",
    "expert_w3",
    "num_experts_attr",
    "top_k_attr",
    "shared_experts_pattern",
    "shared_experts_gate_pattern",
)
_ACTIVATIONS = ("swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai")


class ExpertParallelConfig(ConfigModel):
    """`expert_parallel`: automatic expert parallelism (AutoEP) for Hugging Face MoE models."""

    inert_keys: ClassVar[dict[str, str]] = {
        "expert_tensor_parallel_size": "expert tensor parallelism folded into AutoEP "
        f"{_NOT_IN_DS}; use tensor_parallel.autotp_size for the dense layers without AutoEP, or the MoE "
        "layer's own tensor parallelism",
        "comm_backend": f"the DeepEP exchange {_NOT_IN_DS}; AutoEP uses torch.distributed all-to-all ('comm')",
    }
    ignored_keys: ClassVar[dict[str, str]] = {
        "use_grouped_mm": "a kernel choice; ds runs each local expert's GEMMs in turn",
        "disable_triton_grouped_mm": "a kernel choice; ds runs each local expert's GEMMs in turn",
        "async_split_plan": "a CUDA-stream overlap of the split plan; ds computes it in line",
        "combine_impl": "every combine computes the same weighted sum",
        "gate_up_impl": "a kernel choice for the gate/up projections",
        "comm_num_sm": "read by DeepEP only",
        "comm_qp_margin": "read by DeepEP only",
        "comm_max_tokens_per_rank": "read by DeepEP only",
    }

    enabled: bool = False
    """Replace the model's MoE blocks by expert-parallel layers at initialize()."""
    autoep_size: int = 1
    """Expert-parallel degree: each rank holds num_experts / autoep_size experts; must divide the data-parallel
    world and every MoE block's expert count."""
    expert_tensor_parallel_size: int = 1
    """Tensor parallelism inside each expert; only 1 is accepted."""
    validate_folding_routing: bool = False
    """AutoEP folded with AutoTP: check on every forward that the tensor-parallel lanes routed alike."""
    async_split_plan: bool = False
    preset_model: str | None = None
    """Model family (`mixtral`, `qwen3_moe` (also Qwen2-MoE), `qwen3_5_moe`, `deepseek_v2`, `deepseek_v3`,
    `minimax_m3`); unset: picked from `model.config.model_type`."""
    moe_layer_pattern: str | None = None
    """Regular expression a module path must fully match to be an MoE block."""
    expert_pattern: str | None = None
    router_pattern: str | None = None
    use_grouped_mm: bool = True
    disable_triton_grouped_mm: bool = False
    route_norm: bool | None = None
    """Renormalize the top-k weights; unset: the model config's norm_topk_prob, else the preset's."""
    route_scale: float = 1.0
    """Factor on the routing weights (the model's routed_scaling_factor wins when it has one)."""
    score_apply: Literal["auto", "pre", "post"] = "auto"
    combine_impl: Literal["auto", "weighted_sum", "fused_weighted_sum", "legacy_bmm"] = "auto"
    row_weighting_impl: Literal["auto", "eager", "fused"] = "auto"
    gate_up_impl: Literal["separate", "fused"] = "separate"
    comm_backend: Literal["comm", "deepep"] = "comm"
    comm_num_sm: int = 12
    comm_qp_margin: int = 4
    comm_max_tokens_per_rank: int = 0
    num_expert_groups: int | None = None
    num_limited_groups: int | None = None
    score_func: Literal["auto", "softmax", "sigmoid"] = "auto"
    top_k: int | Literal["auto"] = "auto"
    load_balance_coeff: None = None
    """Expert-bias load balancing; only null is accepted (as in DeepSpeed)."""
    routed_scaling_factor: float | Literal["auto"] = "auto"
    expert_w1: str | None = None
    expert_w2: str | None = None
    expert_w3: str | None = None
    """The up projection's name; null (given) means gate and up are fused in expert_w1."""
    num_experts_attr: str | None = None
    top_k_attr: str | None = None
    has_shared_experts: bool | None = None
    shared_experts_pattern: str | None = None
    shared_experts_gate_pattern: str | None = None
    expert_activation: Literal["swiglu", "geglu_tanh", "swiglu_clamped", "swiglu_oai"] | None = None

    #: keys whose "auto" is DeepSpeed's own value (resolved from the model), not a placeholder to fill
    literal_auto: ClassVar[tuple[str, ...]] = (
        "score_apply",
        "combine_impl",
        "row_weighting_impl",
        "score_func",
        "top_k",
        "routed_scaling_factor",
    )

    @property
    def _load_balance_coeff_explicit(self) -> bool:
        """Whether the section named `load_balance_coeff` (DeepSpeed records it; only null is accepted)."""
        return "load_balance_coeff" in self.model_fields_set

    @model_validator(mode="before")
    @classmethod
    def _refuse_load_balance(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("load_balance_coeff") is not None:
            raise ValueError(
                f"load_balance_coeff={data['load_balance_coeff']!r} is not supported (it would register an expert_bias "
                "for auxiliary-loss-free load balancing, which DeepSpeed refuses too); set it to null or omit the key"
            )
        return data

    @model_validator(mode="after")
    def _check(self) -> ExpertParallelConfig:
        if self.autoep_size < 1:
            raise ValueError(f"autoep_size={self.autoep_size} must be >= 1")
        for name in ("num_expert_groups", "num_limited_groups"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name}={value} must be >= 1")
        if self.num_expert_groups is not None and self.num_limited_groups is not None:
            if self.num_limited_groups > self.num_expert_groups:
                raise ValueError(
                    f"num_limited_groups ({self.num_limited_groups}) must be <= num_expert_groups "
                    f"({self.num_expert_groups})"
                )
        if isinstance(self.top_k, int) and self.top_k < 1:
            raise ValueError(f"top_k={self.top_k} must be >= 1 or 'auto'")
        for name in _DIRECT_NAMES:
            value = getattr(self, name)
            if value is not None and (value == "" or "." in value):
                raise ValueError(f"{name}={value!r} must be a non-empty direct attribute name (no dots)")
        if self.row_weighting_impl == "fused":
            raise ValueError(
                "row_weighting_impl='fused' runs only inside the DeepEP exchange (comm_backend='deepep'), which "
                f"{_NOT_IN_DS}; leave it unset"
            )
        if self.gate_up_impl == "fused" and not self.use_grouped_mm:
            raise ValueError("gate_up_impl='fused' needs use_grouped_mm=true; set it, or leave gate_up_impl unset")
        if self.comm_num_sm < 1:
            raise ValueError(f"comm_num_sm={self.comm_num_sm} must be a positive integer")
        if self.comm_qp_margin < 0 or self.comm_max_tokens_per_rank < 0:
            raise ValueError("comm_qp_margin and comm_max_tokens_per_rank must be non-negative integers")
        return self
