"""sequence_parallel_size and seq_parallel_communication_data_type: read, validated, steering the reduction dtype."""

from __future__ import annotations

import pytest
import torch

from ds_engine._parallel.sequence_parallel import check_sequence_parallel
from ds_engine._plan.dist_info import DistInfo
from ds_engine._plan.plan import plan_assembly, reduction_dtype
from ds_engine.config import DeepSpeedConfig, DeepSpeedConfigError

BASE = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}


def test_seq_parallel_dtype_replaces_communication_dtype_when_sequence_parallel() -> None:
    cfg = DeepSpeedConfig(
        {
            **BASE,
            "sequence_parallel_size": 2,
            "seq_parallel_communication_data_type": "BF16",
            "communication_data_type": "fp16",
        },
        world_size=1,
    )
    assert reduction_dtype(cfg) is torch.bfloat16
    plan = plan_assembly(cfg, device_type="cpu")
    assert plan.reduce is not None and plan.reduce.comm_dtype is torch.bfloat16  # SP peers reduce at stage 0


def test_seq_parallel_dtype_has_no_effect_without_sequence_parallel() -> None:
    cfg = DeepSpeedConfig(
        {**BASE, "seq_parallel_communication_data_type": "bf16", "communication_data_type": "fp16"}, world_size=2
    )
    assert reduction_dtype(cfg) is torch.float16
    assert DeepSpeedConfig(BASE, world_size=1).parsed.seq_parallel_communication_data_type == "fp32"
    assert reduction_dtype(DeepSpeedConfig(BASE, world_size=1)) is None


@pytest.mark.parametrize(
    ("key", "value"), [("sequence_parallel_size", 0), ("seq_parallel_communication_data_type", "int8")]
)
def test_bad_values_name_the_key(key: str, value: object) -> None:
    with pytest.raises(DeepSpeedConfigError, match=key):
        DeepSpeedConfig({**BASE, key: value}, world_size=1)


def test_batch_counts_replicas_not_sequence_peers() -> None:
    dist = DistInfo(world_size=4, dp_world_size=4, sp_world_size=2)
    assert dist.replica_world_size == 2
    cfg = DeepSpeedConfig({**BASE, "train_batch_size": 4, "sequence_parallel_size": 2}, world_size=2)
    assert cfg.batch is not None and cfg.batch.gradient_accumulation_steps == 2


def test_config_and_mpu_degrees_must_agree() -> None:
    with pytest.raises(
        ValueError,
        match=r"sequence_parallel_size=2 in the config but the mpu.*is 1; set "
        r'"sequence_parallel_size": 1',
    ):
        check_sequence_parallel(2, DistInfo(), pipeline=False)
    with pytest.raises(ValueError, match="not supported with a PipelineModule"):
        check_sequence_parallel(2, DistInfo(sp_world_size=2), pipeline=True)
    assert check_sequence_parallel(2, DistInfo(sp_world_size=2, dp_world_size=2), pipeline=False) == 2


def test_unset_key_takes_the_mpus_degree() -> None:
    """DeepSpeed reads the degree from the mpu; a config that leaves the key unset runs with it."""
    assert check_sequence_parallel(1, DistInfo(sp_world_size=2, dp_world_size=2), pipeline=False, given=False) == 2
    assert check_sequence_parallel(1, DistInfo(), pipeline=False, given=False) == 1
    with pytest.raises(ValueError, match="set .*sequence_parallel_size.*: 2"):
        check_sequence_parallel(1, DistInfo(sp_world_size=2, dp_world_size=2), pipeline=False, given=True)
