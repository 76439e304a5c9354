"""DeepSpeed's import paths after `import ds_engine as deepspeed`: `from ds_engine.pipe import ...` and friends.

Each path gives the sibling's own object (never a copy); the optional ones (pipe, zero, checkpointing)
name the extra to install when the sibling is missing (checked in a subprocess with the sibling
blocked), and `import ds_engine` alone loads none of them (also test_import_clean.py).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import ds_comm
import ds_engine as deepspeed
import ds_ops


def test_hard_dependency_paths_are_the_siblings_objects() -> None:
    import ds_engine.comm as dist
    from ds_engine.accelerator import get_accelerator, is_current_accelerator_supported
    from ds_engine.ops.adagrad import DeepSpeedCPUAdagrad
    from ds_engine.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from ds_engine.ops.aio import AsyncIOBuilder
    from ds_engine.ops.lion import DeepSpeedCPULion
    from ds_engine.runtime.lr_schedules import OneCycle, WarmupDecayLR, WarmupLR
    from ds_engine.utils import log_dist, logger

    assert dist.init_distributed is ds_comm.init_distributed and dist.get_rank is ds_comm.get_rank
    assert dist.all_reduce is ds_comm.all_reduce and dist.ReduceOp is ds_comm.ReduceOp
    assert get_accelerator is ds_comm.get_accelerator
    assert is_current_accelerator_supported is ds_comm.is_current_accelerator_supported
    assert (DeepSpeedCPUAdam, FusedAdam, DeepSpeedCPUAdagrad, DeepSpeedCPULion) == (
        ds_ops.DeepSpeedCPUAdam,
        ds_ops.FusedAdam,
        ds_ops.DeepSpeedCPUAdagrad,
        ds_ops.DeepSpeedCPULion,
    )
    assert deepspeed.ops.adam.DeepSpeedCPUAdam is ds_ops.DeepSpeedCPUAdam
    assert AsyncIOBuilder is deepspeed.ops.aio.AsyncIOBuilder is ds_ops.op_builder.AsyncIOBuilder
    assert (WarmupLR, WarmupDecayLR, OneCycle) == (
        deepspeed.lr_schedules.WarmupLR,
        deepspeed.lr_schedules.WarmupDecayLR,
        deepspeed.lr_schedules.OneCycle,
    )
    assert deepspeed.runtime.lr_schedules.WarmupLR is WarmupLR
    assert log_dist is ds_comm.log_dist and logger.name == "DeepSpeed" and deepspeed.utils.logger is logger


def test_pipe_zero_and_checkpointing_paths_are_the_siblings_objects() -> None:
    ds_pipe = pytest.importorskip("ds_pipe", reason="needs ds-pipe: pip install 'ds-engine[pipe]'")
    ds_zero = pytest.importorskip("ds_zero", reason="needs ds-zero: pip install 'ds-engine[zero]'")
    from ds_engine.checkpointing import checkpoint, configure
    from ds_engine.pipe import LayerSpec, PipelineModule, ProcessTopology, TiedLayerSpec
    from ds_engine.runtime.activation_checkpointing import checkpointing
    from ds_engine.runtime.pipe import PipelineModule as RuntimePipelineModule
    from ds_engine.runtime.pipe.schedule import ForwardPass, TrainSchedule
    from ds_engine.runtime.pipe.topology import PipeModelDataParallelTopology
    from ds_engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from ds_engine.zero import GatheredParameters, Init

    assert (PipelineModule, LayerSpec, TiedLayerSpec, ProcessTopology) == (
        ds_pipe.PipelineModule,
        ds_pipe.LayerSpec,
        ds_pipe.TiedLayerSpec,
        ds_pipe.ProcessTopology,
    )
    assert deepspeed.pipe.PipelineModule is deepspeed.PipelineModule is ds_pipe.PipelineModule
    assert (Init, GatheredParameters) == (ds_zero.Init, ds_zero.GatheredParameters)
    assert deepspeed.zero.Init is ds_zero.Init and deepspeed.zero.GatheredParameters is ds_zero.GatheredParameters
    assert (checkpoint, configure) == (ds_pipe.checkpointing.checkpoint, ds_pipe.checkpointing.configure)
    assert deepspeed.checkpointing.checkpoint is ds_pipe.checkpointing.checkpoint
    assert "PipelineModule" in dir(deepspeed.pipe) and "Init" in deepspeed.zero.__all__
    assert RuntimePipelineModule is ds_pipe.PipelineModule
    assert PipeModelDataParallelTopology is ds_pipe.PipeModelDataParallelTopology
    assert (TrainSchedule, ForwardPass) == (ds_pipe.schedule.TrainSchedule, ds_pipe.schedule.ForwardPass)
    assert checkpointing.checkpoint is ds_pipe.checkpointing.checkpoint
    assert deepspeed.runtime.pipe.topology.ProcessTopology is ds_pipe.ProcessTopology
    assert get_fp32_state_dict_from_zero_checkpoint is ds_zero.get_fp32_state_dict_from_zero_checkpoint
    assert (
        deepspeed.utils.zero_to_fp32.load_state_dict_from_zero_checkpoint
        is ds_zero.load_state_dict_from_zero_checkpoint
    )
    with pytest.raises(
        AttributeError,
        match="module 'ds_engine.pipe' has no attribute 'NoSuchThing' "
        r"\(ds_pipe does not provide it\)",
    ):
        _ = deepspeed.pipe.NoSuchThing
    with pytest.raises(ImportError, match="cannot import name 'NoSuchThing'"):
        exec("from ds_engine.zero import NoSuchThing", {})


_BLOCKED = textwrap.dedent("""
    import sys
    sys.modules["ds_pipe"] = None   # as if ds-pipe and ds-zero were not installed
    sys.modules["ds_zero"] = None
    import ds_engine as deepspeed
    from ds_engine.runtime.lr_schedules import WarmupLR   # hard-dependency paths still work
    from ds_engine.ops.adam import DeepSpeedCPUAdam
    import ds_engine.comm as dist
    from ds_engine.utils import logger, log_dist
    for statement in ["from ds_engine.pipe import PipelineModule, LayerSpec", "import ds_engine.pipe",
                      "deepspeed.pipe.LayerSpec", "deepspeed.PipelineModule", "from ds_engine.zero import Init",
                      "deepspeed.zero.Init", "deepspeed.checkpointing.checkpoint",
                      "from ds_engine.runtime.pipe.topology import ProcessTopology",
                      "from ds_engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint"]:
        try:
            exec(statement)
        except ImportError as err:
            print(f"{statement} -> {type(err).__name__}: {err}")
        else:
            print(f"{statement} -> imported")
    print("loaded:", sorted(m for m in sys.modules if m.startswith(("ds_engine.pipe", "ds_engine.zero",
                                                                    "ds_engine.runtime.pipe", "ds_engine.utils.z"))))
""")


def test_missing_extras_name_the_pip_command() -> None:
    proc = subprocess.run([sys.executable, "-c", _BLOCKED], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    lines = dict(line.split(" -> ", 1) for line in proc.stdout.splitlines() if " -> " in line)
    pipe = (
        "ImportError: ds_engine.pipe (deepspeed.pipe, pipeline parallelism) needs ds-pipe: pip install "
        "'ds-engine[pipe]'"
    )
    zero = "ImportError: ds_engine.zero (deepspeed.zero, ZeRO) needs ds-zero: pip install 'ds-engine[zero]'"
    assert lines["from ds_engine.pipe import PipelineModule, LayerSpec"] == pipe
    assert lines["import ds_engine.pipe"] == pipe and lines["deepspeed.pipe.LayerSpec"] == pipe
    assert lines["deepspeed.PipelineModule"] == (
        "ImportError: deepspeed.PipelineModule needs ds-pipe: pip install 'ds-engine[pipe]'"
    )
    assert lines["from ds_engine.zero import Init"] == zero and lines["deepspeed.zero.Init"] == zero
    assert lines["deepspeed.checkpointing.checkpoint"] == (
        "ImportError: ds_engine.checkpointing (deepspeed.checkpointing, activation checkpointing) needs ds-pipe: "
        "pip install 'ds-engine[pipe]'"
    )
    assert lines["from ds_engine.runtime.pipe.topology import ProcessTopology"] == (
        "ImportError: ds_engine.runtime.pipe (deepspeed.runtime.pipe, pipeline parallelism) needs ds-pipe: pip install "
        "'ds-engine[pipe]'"
    )
    assert lines["from ds_engine.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint"] == (
        "ImportError: ds_engine.utils.zero_to_fp32 (deepspeed.utils.zero_to_fp32, ZeRO checkpoint consolidation) "
        "needs ds-zero: pip install 'ds-engine[zero]'"
    )
    assert "loaded: []" in proc.stdout  # a failed import leaves no half-made shim behind


def test_profiler_and_muon_paths() -> None:
    from ds_engine.profiling.flops_profiler import FlopsProfiler, get_model_profile
    from ds_engine.profiling.flops_profiler.profiler import FlopsProfiler as Profiler2

    assert FlopsProfiler is Profiler2 and callable(get_model_profile)
    pytest.importorskip("ds_zero", reason="deepspeed.runtime.zero.* needs ds-zero")
    from ds_engine.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    from ds_engine.runtime.zero.muon.original_muon import muon_update, zeropower_via_newtonschulz5

    assert MuonWithAuxAdam is ds_ops.MuonWithAuxAdam and muon_update is ds_ops.muon_update
    assert zeropower_via_newtonschulz5 is ds_ops.newton_schulz_orthogonalize
