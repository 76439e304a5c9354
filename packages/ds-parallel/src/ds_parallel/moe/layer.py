"""`MoE` (DeepSpeed's `deepspeed.moe.layer.MoE`): a mixture-of-experts layer with expert parallelism."""

from __future__ import annotations

import logging

from torch import Tensor, nn
from torch.nn import functional as F

from ds_parallel.moe._groups import expert_group_name, get_expert_groups
from ds_parallel.moe.experts import Experts
from ds_parallel.moe.sharded_moe import MOELayer, TopKGate

logger = logging.getLogger(__name__)

__all__ = ["MoE"]


class MoE(nn.Module):
    """Replace a dense block by `num_experts` copies of `expert` of which each token uses k.

    The experts are sharded over `ep_size` ranks (E / ep_size local experts each, global expert
    `ep_rank * E/ep + i` is local `deepspeed_moe.experts.deepspeed_experts.i`); ranks of one expert-parallel
    group exchange tokens by all-to-all. Groups are made by `set_deepspeed_parallelism()`, which
    `deepspeed.initialize()` calls for every MoE layer.

    Args:
        hidden_size: input and output width.
        expert: the expert module (`[..., hidden] -> [..., hidden]`; a tuple output's first item is used).
        num_experts: experts over all ranks.
        ep_size: expert-parallel degree; divides num_experts and the data-parallel world.
        k: experts per token.
        capacity_factor / eval_capacity_factor: capacity multipliers in training / eval.
        min_capacity: the least slots per expert.
        use_residual: Residual-MoE: also run `expert` densely (as `mlp`) and mix both outputs with a
            learned per-token softmax coefficient (`coefficient`, a `Linear(hidden, 2)`).
        noisy_gate_policy: None, "Jitter" or "RSample".
        drop_tokens: enforce capacity.
        use_rts: random token selection when dropping (top-1).
        use_tutel: accepted; Tutel is not used.
        enable_expert_tensor_parallelism: with a tensor-parallel model, `expert` is itself tensor-parallel
            (its layers shard over the model's tensor-parallel group): expert groups are formed inside each
            tensor-parallel lane and every tensor-parallel rank runs its shard on all of an expert's tokens.
            Off (the default), experts are whole on each rank and tensor-parallel peers split the tokens.
        top2_2nd_expert_sampling: Gumbel-sample top-2's second expert.

    `forward(hidden_states, used_token=None)` returns `(output, l_aux, exp_counts)`.

    Raises:
        ValueError: num_experts not divisible by ep_size, an unknown noisy_gate_policy.
    """

    def __init__(
        self,
        hidden_size: int,
        expert: nn.Module,
        num_experts: int = 1,
        ep_size: int = 1,
        k: int = 1,
        capacity_factor: float = 1.0,
        eval_capacity_factor: float = 1.0,
        min_capacity: int = 4,
        use_residual: bool = False,
        noisy_gate_policy: str | None = None,
        drop_tokens: bool = True,
        use_rts: bool = True,
        use_tutel: bool = False,
        enable_expert_tensor_parallelism: bool = False,
        top2_2nd_expert_sampling: bool = True,
    ) -> None:
        super().__init__()
        if ep_size < 1 or num_experts < 1 or num_experts % ep_size:
            raise ValueError(f"MoE: num_experts ({num_experts}) must be a positive multiple of ep_size ({ep_size})")
        self.use_residual = use_residual
        self.enable_expert_tensor_parallelism = enable_expert_tensor_parallelism
        self.ep_size = ep_size
        self.expert_group_name = expert_group_name(ep_size)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // ep_size
        logger.info(
            "MoE layer: %d experts, %d local, expert-parallel size %d", num_experts, self.num_local_experts, ep_size
        )
        gate = TopKGate(
            hidden_size,
            num_experts,
            k,
            capacity_factor,
            eval_capacity_factor,
            min_capacity,
            noisy_gate_policy,
            drop_tokens,
            use_rts,
            None,
            top2_2nd_expert_sampling,
        )
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        self.deepspeed_moe = MOELayer(
            gate, experts, self.expert_group_name, ep_size, self.num_local_experts, use_tutel=use_tutel
        )
        if use_residual:
            self.mlp = expert
            self.coefficient = nn.Linear(hidden_size, 2)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """Create (or reuse) the `ep_size_{N}` groups and hand the expert-parallel one to the layer.

        A collective over the world the first time a degree is seen. The tensor-parallel degree is the
        model's (`ds_parallel.groups`: the published mpu's, else the mesh's `tp`); the layouts are
        DeepSpeed's (`ds_parallel.moe._layouts`): E + D (or D + E with `use_data_before_expert_parallel_`)
        over the world, or inside each tensor-parallel lane with `enable_expert_tensor_parallelism`.

        Raises:
            ValueError: ep_size does not divide the ranks it splits.
        """
        from ds_parallel import groups

        tp_size, tp_group, _ = groups._tensor_parallel()
        expert_tp = self.enable_expert_tensor_parallelism and tp_size > 1
        if expert_tp:
            groups._create_expert_data_and_model_parallel(
                self.ep_size, mpu=groups.mpu, use_data_before_expert_parallel_=use_data_before_expert_parallel_
            )
        elif self.expert_group_name not in groups._get_expert_parallel_group_dict():
            groups._create_expert_and_data_parallel(
                self.ep_size, use_data_before_expert_parallel_=use_data_before_expert_parallel_
            )
        expert_groups = get_expert_groups(self.expert_group_name)
        if self.deepspeed_moe.ep_group is not expert_groups.ep_group:
            self.deepspeed_moe._set_ep_group(expert_groups.ep_group)
        self.deepspeed_moe._set_tensor_parallel(tp_group, tp_size, expert_tp)
        logger.info(
            "MoE layer %s: tensor-parallel degree %d, experts %s",
            self.expert_group_name,
            tp_size,
            "tensor-parallel" if expert_tp else "whole on each rank",
        )

    def _create_process_groups(self, use_data_before_expert_parallel_: bool = False) -> None:
        self.set_deepspeed_parallelism(use_data_before_expert_parallel_)

    def forward(self, hidden_states: Tensor, used_token: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """`(output, l_aux, exp_counts)` for `hidden_states [..., hidden_size]`."""
        output = self.deepspeed_moe(hidden_states, used_token)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            if isinstance(dense, tuple):
                dense = dense[0]
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        l_aux, exp_counts = self.deepspeed_moe.l_aux, self.deepspeed_moe.exp_counts
        assert l_aux is not None and exp_counts is not None
        return output, l_aux, exp_counts
