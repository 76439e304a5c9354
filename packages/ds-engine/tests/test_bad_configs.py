"""A table of bad configs: each raises in initialize(), before any training, with a message naming the key."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from ds_engine_testkit import base_config, flat_params, tiny_net

import ds_engine
from ds_engine import DeepSpeedConfigError
from ds_engine._report.monitors import tensorboard_available

E = DeepSpeedConfigError
SGD = {"type": "SGD", "params": {"lr": 0.1}}

# (id, config overrides on top of a valid base config, exception type, regex the message must match)
BAD: list[tuple[str, dict[str, Any], type[Exception], str]] = [
    (
        "fp16_and_bf16",
        {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
        E,
        r"fp16.enabled and bf16.enabled are both true",
    ),
    (
        "apex_amp",
        {"amp": {"enabled": True, "opt_level": "O1"}},
        E,
        r"amp: key 'amp' is not supported by ds: NVIDIA Apex AMP was removed .* \"bf16\"",
    ),
    (
        "zero_untested_optimizer",
        {"zero_optimization": {"stage": 1}, "optimizer": SGD},
        E,
        r"optimizer.type='SGD' is not tested with ZeRO .* \"zero_allow_untested_optimizer\": true",
    ),
    ("zero_bad_stage", {"zero_optimization": {"stage": 5}}, E, r"zero_optimization.stage: must be 0, 1, 2 or 3, got 5"),
    (
        "bf16_masters_stage0",
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}},
        E,
        r"bf16.bf16_master_weights_and_grads=true is only supported with ZeRO stage 1, 2 or 3",
    ),
    (
        "bf16_states_without_masters",
        {"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}},
        E,
        r"bf16.bf16_optimizer_states=true needs bf16.bf16_master_weights_and_grads=true",
    ),
    (
        "bf16_masters_without_states",
        {"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "zero_optimization": {"stage": 3}},
        E,
        r"bf16.bf16_master_weights_and_grads=true with bf16.bf16_optimizer_states=false keeps fp32 moments .* "
        r"needs zero_optimization.offload_optimizer.device 'cpu' or 'nvme'",
    ),
    (
        "bf16_masters_without_bf16",
        {
            "bf16": {"enabled": False, "bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
            "zero_optimization": {"stage": 1},
        },
        E,
        r"bf16.bf16_master_weights_and_grads=true applies to bf16 training: set bf16.enabled=true",
    ),
    (
        "weight_quant_post_init",
        {"weight_quantization": {"post_init_quant": {"fc": {"num_bits": 8, "group_size": 32}}}},
        E,
        r"weight_quantization.post_init_quant: post-init weight quantization .* is not implemented in ds",
    ),
    (
        "weight_quant_bits",
        {"weight_quantization": {"quantized_initialization": {"num_bits": 2, "group_size": 32, "group_dim": 1}}},
        E,
        r"weight_quantization.quantized_initialization.num_bits: Input should be 4 or 8",
    ),
    (
        "zero_not_a_section",
        {"zero_optimization": "yes"},
        E,
        r"zero_optimization: expected a section \(object\) or true/false, got 'yes'",
    ),
    (
        "top_level_typo",
        {"gradient_cliping": 1.0},
        E,
        r"gradient_cliping: unknown key .*did you mean 'gradient_clipping'",
    ),
    (
        "nested_typo",
        {"fp16": {"enabled": True, "loss_scale_windw": 100}},
        E,
        r"fp16.loss_scale_windw: unknown key .*did you mean 'loss_scale_window'",
    ),
    (
        "bf16_old_overflow_key",
        {"bf16": {"enabled": True, "check_overflow": True}},
        E,
        r"bf16.check_overflow: unknown key .*did you mean 'check_grad_overflow'",
    ),
    ("optimizer_unknown", {"optimizer": {"type": "AdamWW"}}, E, r"optimizer.type: 'AdamWW' is not a known optimizer"),
    ("optimizer_lowercase_torch", {"optimizer": {"type": "rmsprop"}}, E, r"optimizer.type: .*did you mean 'RMSprop'"),
    (
        "optimizer_removed_onebit",
        {"optimizer": {"type": "OneBitAdam"}},
        E,
        r"optimizer.type: optimizer 'OneBitAdam' is not supported: 1-bit Adam was removed",
    ),
    (
        "optimizer_param_typo",
        {"optimizer": {"type": "Adam", "params": {"lr": 0.1, "beta": [0.9, 0.99]}}},
        E,
        r"optimizer.params.beta: 'beta' is not a parameter of optimizer 'adam'; did you mean 'betas'",
    ),
    (
        "optimizer_max_grad_norm",
        {"optimizer": {"type": "Adam", "params": {"max_grad_norm": 1.0}}},
        E,
        r"optimizer.params.max_grad_norm: .*use the top-level \"gradient_clipping\"",
    ),
    ("optimizer_type_not_string", {"optimizer": {"type": 3}}, E, r"optimizer.type: .*type must be a string"),
    (
        "muon_param_typo",
        {"optimizer": {"type": "Muon", "params": {"momentun": 0.9}}},
        E,
        r"optimizer.params.momentun: 'momentun' is not a parameter of optimizer 'muon'; did you mean 'momentum'",
    ),
    (
        "muon_per_head",
        {"optimizer": {"type": "Muon", "params": {"per_head_muon": "yes"}}},
        E,
        r"optimizer.params.per_head_muon: per_head_muon must be true or false, got 'yes'",
    ),
    (
        "muon_ns_method",
        {"optimizer": {"type": "Muon", "params": {"ns_method": "svd"}}},
        E,
        r"optimizer.params.ns_method: ns_method must be 'gram' or 'standard', got 'svd'",
    ),
    (
        "muon_zero3_nvme",
        {
            "optimizer": {"type": "muon"},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
        },
        E,
        r"zero_optimization.offload_optimizer.device: Muon at ZeRO stage 3 with NVMe optimizer offload",
    ),
    (
        "muon_momentum_in_memory_not_bool",
        {"optimizer": {"type": "muon"}, "zero_optimization": {"stage": 3, "save_muon_momentum_buffer_in_memory": "x"}},
        E,
        r"zero_optimization.save_muon_momentum_buffer_in_memory",
    ),
    ("scheduler_unknown", {"scheduler": {"type": "WarmUpLR"}}, E, r"scheduler.type.*did you mean 'WarmupLR'"),
    (
        "scheduler_missing_param",
        {"scheduler": {"type": "WarmupCosineLR", "params": {}}},
        E,
        r"scheduler.params.total_num_steps: WarmupCosineLR needs 'total_num_steps'",
    ),
    (
        "scheduler_param_typo",
        {
            "scheduler": {
                "type": "OneCycle",
                "params": {"cycle_min_lr": 0.1, "cycle_max_lr": 1, "cycle_frist_step_size": 5},
            }
        },
        E,
        r"scheduler.params.cycle_frist_step_size: .*did you mean 'cycle_first_step_size'",
    ),
    (
        "batch_mismatch",
        {"train_batch_size": 10, "gradient_accumulation_steps": 2},
        E,
        r"train_batch_size \(10\) must equal train_micro_batch_size_per_gpu \(4\) x gradient_accumulation_steps \(2\)",
    ),
    (
        "batch_not_divisible",
        {"train_batch_size": 10, "train_micro_batch_size_per_gpu": None, "gradient_accumulation_steps": 4},
        E,
        r"train_micro_batch_size_per_gpu: .*= 10 / 4 = 2.5 is not a whole number",
    ),
    (
        "batch_bool",
        {"train_micro_batch_size_per_gpu": True},
        E,
        r"train_micro_batch_size_per_gpu: expected an integer, got the boolean True",
    ),
    ("batch_negative", {"gradient_accumulation_steps": -2}, E, r"gradient_accumulation_steps: Input should be greater"),
    (
        "dynamic_window_zero",
        {"fp16": {"enabled": True, "loss_scale_window": 0}},
        E,
        r"fp16: loss_scale_window=0 must be > 0 with dynamic loss scaling",
    ),
    (
        "loss_scale_negative",
        {"fp16": {"enabled": True, "loss_scale": -1}},
        E,
        r"fp16.loss_scale: Input should be greater",
    ),
    (
        "loss_scale_inf",
        {"fp16": {"enabled": True, "loss_scale": float("inf")}},
        E,
        r"fp16.loss_scale: .*expected a finite number",
    ),
    (
        "min_loss_scale_above_initial",
        {"fp16": {"enabled": True, "initial_scale_power": 4, "min_loss_scale": 64}},
        E,
        r"fp16: min_loss_scale=64.0 is above the initial loss scale 2\*\*initial_scale_power = 16 "
        r"\(initial_scale_power=4\)",
    ),
    (
        "fp16_master_weights_without_offload",
        {"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}, "zero_optimization": {"stage": 2}},
        E,
        r"fp16.fp16_master_weights_and_grads=true keeps fp32 moments beside fp16 masters on the host, which needs "
        r"ZeRO stage 1, 2 or 3 with zero_optimization.offload_optimizer.device 'cpu' .*got stage 2, "
        r"offload_optimizer.device 'none'",
    ),
    (
        "fp16_master_weights_without_fp16",
        {"fp16": {"fp16_master_weights_and_grads": True}},
        E,
        r"fp16.fp16_master_weights_and_grads=true applies to fp16 training: set fp16.enabled=true",
    ),
    (
        "legacy_fusion_fp16_stage0",
        {"optimizer": {"type": "Adam", "legacy_fusion": True}, "fp16": {"enabled": True}},
        E,
        r"optimizer.legacy_fusion=true with fp16 at ZeRO stage 0 selects DeepSpeed's legacy fused fp16 step",
    ),
    (
        "lamb_static_fp16",
        {"optimizer": {"type": "Lamb"}, "fp16": {"enabled": True, "loss_scale": 64}},
        E,
        r"optimizer.type='lamb' with fp16 needs dynamic loss scaling; set fp16.loss_scale to 0",
    ),
    (
        "tag_validation",
        {"checkpoint": {"tag_validation": "maybe"}},
        E,
        r"checkpoint.tag_validation: Input should be 'WARN', 'IGNORE' or 'FAIL' \(got 'MAYBE'\)",
    ),
    ("allreduce_op", {"gradient_allreduce_op": "avg"}, E, r"gradient_allreduce_op: Invalid gradient_allreduce_op 'avg"),
    ("comm_dtype", {"communication_data_type": "int8"}, E, r"communication_data_type: Input should be 'fp32', 'fp16'"),
    ("clipping_negative", {"gradient_clipping": -1.0}, E, r"gradient_clipping: Input should be greater than or equal"),
    ("steps_per_print_zero", {"steps_per_print": 0}, E, r"steps_per_print: Input should be greater than 0"),
    ("comet_interval_zero", {"comet": {"samples_log_interval": 0}}, E, r"comet.samples_log_interval: Input should be"),
    (
        "flops_profiler_depth",
        {"flops_profiler": {"enabled": True, "module_depth": -2}},
        E,
        r"flops_profiler.module_depth: .*must be -1 \(all\) or >= 0, got -2",
    ),
    (
        "torch_autocast_fp32",
        {"torch_autocast": {"enabled": True, "dtype": "float32"}},
        E,
        r"torch_autocast.dtype: .*autocast to fp32 does nothing",
    ),
    (
        "hybrid_engine_tensor_parallel",
        {"hybrid_engine": {"enabled": True, "inference_tp_size": 2}},
        E,
        r"hybrid_engine.inference_tp_size: 'inference_tp_size'=2 is not supported by ds \(tensor-parallel generation",
    ),
    (
        "removed_sparse_attention",
        {"sparse_attention": {"mode": "fixed"}},
        E,
        r"sparse_attention: .*sparse attention was removed in DeepSpeed 0.19",
    ),
    ("removed_curriculum", {"curriculum_learning": {"enabled": True}}, E, r"curriculum_learning: .*data_efficiency"),
    (
        "param_dtype_conflict",
        {"bf16": {"enabled": True}, "data_types": {"param_dtype": "fp16"}},
        E,
        r"data_types.param_dtype='fp16' conflicts with the precision mode \(bf16",
    ),
    (
        "grad_accum_mix",
        {"data_types": {"grad_accum_dtype": "bf16"}},
        E,
        r"data_types.grad_accum_dtype='bf16' is not supported with fp32 parameters",
    ),
    (
        "activation_ckpt",
        {"activation_checkpointing": {"contiguous_memory_optimization": True}},
        E,
        r"activation_checkpointing: contiguous_memory_optimization needs number_checkpoints",
    ),
    (
        "pipeline_partition",
        {"pipeline": {"partition": "bogus"}},
        E,
        r"pipeline.partition: unknown partition method 'bogus'",
    ),
    ("pipeline_not_a_section", {"pipeline": 3}, E, r"pipeline: expected a section \(object\), got 3"),
    ("pipeline_typo", {"pipeline": {"stage": 2}}, E, r"pipeline.stage: unknown key .*did you mean 'stages'"),
    ("comms_logger_typo", {"comms_logger": {"enable": True}}, E, r"comms_logger.enable: .*did you mean 'enabled'"),
    (
        "unfilled_auto",
        {"gradient_clipping": "auto", "optimizer": {"type": "Adam", "params": {"lr": "auto"}}},
        E,
        r"gradient_clipping, optimizer.params.lr: still \"auto\"",
    ),
    (
        "zenflow_auto_strategy_with_interval",  # DeepSpeed refuses it too (select_interval would be overwritten)
        {
            "zero_optimization": {
                "stage": 2,
                "offload_optimizer": {"device": "cpu"},
                "zenflow": {"topk_ratio": 0.05, "select_interval": 4, "update_interval": 2},
            }
        },
        E,
        r'zero_optimization.zenflow.select_interval=4: with select_strategy "auto"',
    ),
    (
        "zenflow_without_cpu_offload",
        {"zero_optimization": {"stage": 2, "zenflow": {"update_interval": 2}}},
        E,
        r'zero_optimization.zenflow needs zero_optimization.offload_optimizer.device "cpu"',
    ),
    (
        "zenflow_empty_section",  # present at all = on, as in DeepSpeed
        {"zero_optimization": {"stage": 3, "zenflow": {}}},
        E,
        r'zero_optimization.zenflow needs zero_optimization.offload_optimizer.device "cpu"',
    ),
    (
        "zenflow_stage3_with_super_offload",
        {
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "cpu", "super_offload": True},
                "zenflow": {"select_strategy": "step", "select_interval": 2, "update_interval": 2},
            }
        },
        E,
        r"zero_optimization.zenflow with zero_optimization.offload_optimizer.super_offload=true",
    ),
    (
        "zenflow_bad_ratio",
        {"zero_optimization": {"stage": 2, "zenflow": {"topk_ratio": 1.0}}},
        E,
        r"zero_optimization.zenflow.topk_ratio: Input should be less than 1",
    ),
    (
        "zenflow_typo",
        {"zero_optimization": {"stage": 2, "zenflow": {"update_intervall": 4}}},
        E,
        r"zero_optimization.zenflow.update_intervall: unknown key .*did you mean 'update_interval'",
    ),
    (
        "sum_allreduce_with_zenflow",  # DeepSpeed refuses the pair
        {"gradient_allreduce_op": "SUM", "zero_optimization": {"stage": 2, "zenflow": {}}},
        E,
        r"gradient_allreduce_op='sum' is not supported with ZenFlow \(zero_optimization.zenflow\)",
    ),
    (
        "sum_allreduce_with_deepcompile",
        {"gradient_allreduce_op": "sum", "zero_optimization": {"stage": 1}, "compile": {"deepcompile": True}},
        E,
        r"gradient_allreduce_op='sum' is not supported with DeepCompile \(compile.deepcompile=true\); use 'mean'",
    ),
    (
        "deepcompile_offload_opt_states",  # DeepCompile itself is implemented; its offload modes are not
        {"compile": {"deepcompile": True, "offload_opt_states": True}},
        E,
        r"^invalid config:\n  compile.offload_opt_states: 'offload_opt_states'=True is not supported by ds "
        r"\(optimizer-state offload is not implemented in ds's DeepCompile; use zero_optimization.offload_optimizer",
    ),
    (
        "deepcompile_autosp_pass",
        {"compile": {"deepcompile": True, "passes": ["z3", "autosp"]}},
        E,
        r"compile.passes: .*the 'autosp' pass is not implemented in ds's DeepCompile; use 'z1' or 'z3'",
    ),
    (
        "autoep_size_over_world",
        {"expert_parallel": {"enabled": True, "autoep_size": 2}},
        ValueError,
        r"expert_parallel.autoep_size=2 must divide the data-parallel world size 1",
    ),
    (
        "autoep_folding_with_expert_tp",
        {"expert_parallel": {"enabled": True, "expert_tensor_parallel_size": 2}},
        E,
        r"expert_parallel.expert_tensor_parallel_size: .*expert tensor parallelism folded into AutoEP is not "
        r"implemented in ds",
    ),
    (
        "autoep_load_balance",
        {"expert_parallel": {"enabled": True, "load_balance_coeff": 0.01}},
        E,
        r"expert_parallel: .*load_balance_coeff=0.01 is not supported",
    ),
    (
        "autoep_bad_score_func",
        {"expert_parallel": {"enabled": True, "score_func": "relu"}},
        E,
        r"expert_parallel.score_func: .*'softmax'",
    ),
    (
        "autoep_groups",
        {"expert_parallel": {"num_expert_groups": 2, "num_limited_groups": 3}},
        E,
        r"expert_parallel: .*num_limited_groups \(3\) must be <= num_expert_groups \(2\)",
    ),
    (
        "autoep_deepep",
        {"expert_parallel": {"enabled": True, "comm_backend": "deepep"}},
        E,
        r"expert_parallel.comm_backend: .*DeepEP exchange is not implemented in ds",
    ),
    (
        "autoep_not_an_moe_model",
        {"expert_parallel": {"enabled": True}},
        ValueError,
        r"expert_parallel: no MoE block found in the model; tried mixtral: moe_layer_pattern=",
    ),
    ("autoep_typo", {"expert_parallel": {"autoep_sise": 2}}, E, r"expert_parallel.autoep_sise: .*'autoep_size'"),
    (
        "curriculum_without_cluster_path",  # DeepSpeed acts on it whatever data_efficiency.enabled says
        {"data_efficiency": {"data_sampling": {"curriculum_learning": {"enabled": True}}}},
        E,
        r"data_efficiency.data_sampling.curriculum_learning.data_cluster_path: is required when curriculum "
        r"learning is enabled",
    ),
    (
        "random_ltd_sub_switch",
        {"data_efficiency": {"data_routing": {"random_ltd": {"enabled": True}}}},
        E,
        r"data_efficiency.data_routing.random_ltd: random-LTD is enabled but total_layer_num, random_ltd_layer_num, "
        r"random_ltd_layer_id, model_type, hidden_state_order, random_ltd_schedule is not set",
    ),
    ("autotuning_metric", {"autotuning": {"metric": "speed"}}, E, r"autotuning.metric: Input should be 'throughput'"),
    (
        "autotuning_window",
        {"autotuning": {"start_profile_step": 4, "end_profile_step": 2}},
        E,
        r"autotuning: .*end_profile_step=2 is before start_profile_step=4",
    ),
    ("autotuning_typo", {"autotuning": {"tuner_typ": "random"}}, E, r"autotuning.tuner_typ: .*'tuner_type'"),
    ("compile_typo", {"compile": {"deepcompil": False}}, E, r"compile.deepcompil: unknown key .*'deepcompile'"),
    (
        "data_parallel_size_mismatch",  # DeepSpeed's (data, sequence) mesh would not fit the world either
        {"data_parallel_size": 2, "sequence_parallel_size": 1},
        ValueError,
        r"data_parallel_size=2 with sequence_parallel_size=1, but the data-parallel degree is 1",
    ),
    ("aio_block_size", {"aio": {"block_size": 0}}, E, r"aio.block_size: Input should be greater than 0"),
    ("aio_typo", {"aio": {"queue_dpeth": 16}}, E, r"aio.queue_dpeth: unknown key .*did you mean 'queue_depth'"),
    ("aio_gds", {"aio": {"use_gds": True}}, E, r"aio.use_gds: .*GPUDirect Storage is not supported"),
    (
        "nvme_below_stage_3",
        {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}},
        E,
        r"zero_optimization.offload_optimizer.device='nvme': NVMe offload \(ZeRO-Infinity\) needs "
        r"zero_optimization.stage=3, got 2",
    ),
]


#: rows whose section ds-pipe's models validate (without ds-pipe they fail naming the extra instead,
#: see test_optional_seams)
_NEEDS_DS_PIPE = {"activation_ckpt", "pipeline_typo", "pipeline_partition"}
try:
    import ds_pipe  # noqa: F401

    _NO_DS_PIPE = False
except ImportError:
    _NO_DS_PIPE = True


#: rows that need a ZeRO stage ds-zero validates first (without it the error names the extra instead)
_NEEDS_DS_ZERO = {
    "muon_zero3_nvme",
    "muon_momentum_in_memory_not_bool",
    "zenflow_bad_ratio",
    "zenflow_typo",
    "weight_quant_post_init",
    "weight_quant_bits",
    "zenflow_auto_strategy_with_interval",
    "zenflow_without_cpu_offload",
    "zenflow_empty_section",
    "zenflow_stage3_with_super_offload",
}
_NO_DS_ZERO = importlib.util.find_spec("ds_zero") is None
#: rows whose model check AutoEP (ds-parallel) makes (without it the error names the extra instead)
_NEEDS_DS_PARALLEL = {"autoep_not_an_moe_model"}
_NO_DS_PARALLEL = importlib.util.find_spec("ds_parallel") is None


def _skip(name: str) -> Any:
    if name in _NEEDS_DS_PIPE and _NO_DS_PIPE:
        return pytest.mark.skip(reason="needs ds-pipe: pip install 'ds-engine[pipe]'")
    if name in _NEEDS_DS_ZERO and _NO_DS_ZERO:
        return pytest.mark.skip(reason="needs ds-zero: pip install 'ds-engine[zero]'")
    if name in _NEEDS_DS_PARALLEL and _NO_DS_PARALLEL:
        return pytest.mark.skip(reason="needs ds-parallel: pip install 'ds-engine[parallel]'")
    return []


def _rows() -> list[Any]:
    return [pytest.param(*row[1:], id=row[0], marks=_skip(row[0])) for row in BAD]


@pytest.mark.parametrize(("overrides", "exc", "message"), _rows())
def test_bad_config_raises_before_training_naming_the_key(overrides, exc, message) -> None:
    config = base_config()
    config.update(overrides)
    config = {k: v for k, v in config.items() if v is not None}
    model = tiny_net(0)
    before = flat_params(model)
    with pytest.raises(exc, match=message):
        ds_engine.initialize(model=model, config=config, dist_init_required=False)
    assert torch.equal(flat_params(model), before) and model.l1.weight.dtype == torch.float32


def test_the_table_is_big_enough() -> None:
    assert len(BAD) >= 30


@pytest.mark.skipif(tensorboard_available(), reason="tensorboard is installed here")
def test_tensorboard_enabled_without_the_package() -> None:
    with pytest.raises(
        ImportError,
        match=r"tensorboard.enabled is true but the tensorboard package is not installed: "
        r"pip install tensorboard",
    ):
        ds_engine.initialize(
            model=tiny_net(0), config=base_config(tensorboard={"enabled": True}), dist_init_required=False
        )


def test_engine_time_argument_errors() -> None:
    model = tiny_net(0)
    sched = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(model.parameters(), lr=0.1), step_size=1)
    # these two are AssertionErrors as well (ds_comm.UsageError): DeepSpeed asserts them, and code written
    # for it catches AssertionError
    with pytest.raises(AssertionError, match="a client lr_scheduler instance needs a client optimizer instance"):
        ds_engine.initialize(model=model, lr_scheduler=sched, config=base_config(), dist_init_required=False)
    with pytest.raises(AssertionError, match="model is required"):
        ds_engine.initialize(config=base_config(), dist_init_required=False)
    with pytest.raises(ValueError, match="model is required"):
        ds_engine.initialize(tiny_net(0), config=base_config(), dist_init_required=False)  # positional = args
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got dict"):
        ds_engine.initialize(model={}, config=base_config(), dist_init_required=False)
    with pytest.raises(ValueError, match="pass the config once, got config and config_params"):
        ds_engine.initialize(model=model, config=base_config(), config_params=base_config(), dist_init_required=False)
    with pytest.raises(ValueError, match="needs a config"):
        ds_engine.initialize(model=model, dist_init_required=False)
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer or a callable"):
        ds_engine.initialize(model=model, optimizer=3, config=base_config(), dist_init_required=False)


def test_precision_the_device_cannot_run(monkeypatch) -> None:
    acc = ds_engine.accelerator.get_accelerator()
    monkeypatch.setattr(type(acc), "is_fp16_supported", lambda self: False)
    model = tiny_net(0)
    with pytest.raises(E, match=r"fp16.enabled: fp16 is not supported on this cpu device"):
        ds_engine.initialize(model=model, config=base_config(fp16={"enabled": True}), dist_init_required=False)
    assert model.l1.weight.dtype == torch.float32


def test_sum_allreduce_with_zenflow_and_deepcompile_off_is_accepted() -> None:
    config = ds_engine.DeepSpeedConfig(
        {
            "train_batch_size": 2,
            "gradient_allreduce_op": "sum",
            "zero_optimization": {"stage": 0, "zenflow": None},
            "compile": {"deepcompile": False},
        }
    )
    assert config.parsed.gradient_allreduce_op == "sum"
