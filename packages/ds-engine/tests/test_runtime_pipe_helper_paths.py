"""DeepSpeed's pipeline helpers under `deepspeed.runtime`: `pipe.topology._prime_factors`, `pipe.engine`,
`utils.PartitionedTensor`."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("ds_pipe")


def _is_prime(n: int) -> bool:
    return n > 1 and all(n % d for d in range(2, n))


def test_prime_factors_multiply_back_in_ascending_primes() -> None:
    from ds_engine.runtime.pipe.topology import _prime_factors

    for n in range(1, 200):
        factors = _prime_factors(n)
        assert math.prod(factors) == n and factors == sorted(factors)
        assert all(_is_prime(p) for p in factors), (n, factors)
    assert _prime_factors(1) == [] and _prime_factors(97) == [97] and _prime_factors(360) == [2, 2, 2, 3, 3, 5]
    for bad in (0, -4, 2.0, True):
        with pytest.raises(ValueError, match="positive integer"):
            _prime_factors(bad)  # type: ignore[arg-type]


def test_topology_shim_keeps_serving_ds_pipe_names() -> None:
    import ds_pipe
    from ds_engine.runtime.pipe import topology

    assert topology.ProcessTopology is ds_pipe.ProcessTopology
    assert "_prime_factors" not in topology.__all__  # private, as in DeepSpeed


def test_runtime_utils_partitioned_tensor_is_ds_pipes() -> None:
    import ds_pipe
    from ds_engine.runtime.utils import PartitionedTensor, prefix_sum_inc

    assert PartitionedTensor is ds_pipe.PartitionedTensor and prefix_sum_inc is ds_pipe.prefix_sum_inc


def test_pipe_engine_module_serves_the_engine_and_deepspeeds_constants() -> None:
    import ds_engine
    from ds_engine.runtime.pipe import engine

    assert engine.PipelineEngine is ds_engine.PipelineEngine and issubclass(
        engine.PipelineEngine, ds_engine.DeepSpeedEngine
    )
    assert engine.PipelineError is ds_engine.PipelineError
    # DeepSpeed 0.19.8's values
    assert (engine.TARGET_ID, engine.LOG_STAGE, engine.DATA_PARALLEL_ID, engine.TENSOR_META_SIZE) == (-2, -2, -2, 256)
    assert engine.TRAIN_BATCH_TIMER == "train_batch" and engine.PIPE_RECV_GRAD_TIMER == "pipe_recv_grad"
    assert [engine.is_even(n) for n in (0, 1, 2, 7)] == [True, False, True, False]
