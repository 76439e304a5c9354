"""`MultipleAllGatherHandles` forwards `handle_dependency` by keyword; `Init` initialises torch.distributed;
`Init` and stage 3 leave `torch.nn.functional.linear` alone.

DeepSpeed replaces `F.linear` by its stage-3 linear for the rest of the process once `zero.Init` runs or
a stage-3 model is built; ds-zero's saved-tensor hooks re-gather saved weights for every op, so it does
not. The Init checks run in a fresh interpreter (the test process must not keep a process group, and
nothing another test did to `F.linear` can hide a patch).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from ds_zero import MultipleAllGatherHandles


class _Positional:
    def __init__(self) -> None:
        self.seen: object = None

    def wait(self, handle_dependency: bool = True) -> None:
        self.seen = handle_dependency


class _KeywordOnly:
    def __init__(self) -> None:
        self.seen: object = None

    def wait(self, *, handle_dependency: bool = True) -> None:
        self.seen = handle_dependency


def test_wait_passes_the_flag_by_keyword_to_every_handle() -> None:
    handles = [_Positional(), _KeywordOnly(), _Positional()]
    MultipleAllGatherHandles(handles).wait(handle_dependency=False)
    assert [h.seen for h in handles] == [False, False, False]
    MultipleAllGatherHandles(handles).wait()
    assert [h.seen for h in handles] == [True, True, True]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_fresh(script: str) -> None:
    """Run `script` in a fresh single-process interpreter; it must print OK last."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["MASTER_PORT"] = str(_free_port())
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("OK")


@pytest.mark.timeout(120)
def test_init_initialises_distributed_once_and_disabled_init_does_not() -> None:
    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        import ds_zero
        with ds_zero.Init(enabled=False):
            pass
        assert not dist.is_initialized(), "a disabled Init must not start a process group"
        with ds_zero.Init():
            assert dist.is_initialized() and dist.get_world_size() == 1
            layer = torch.nn.Linear(3, 2)
        assert layer.weight.ds_status is ds_zero.ZeroParamStatus.NOT_AVAILABLE
        with ds_zero.Init():  # already initialised: reused, not re-created
            torch.nn.Linear(2, 2)
        print("OK")
        """
    )
    _run_fresh(script)


@pytest.mark.timeout(120)
def test_init_and_stage3_leave_torch_linear_alone() -> None:
    script = textwrap.dedent(
        """
        import torch
        import torch.nn.functional as F
        import ds_zero
        from ds_zero import InsertPostInitMethodToModuleSubClasses as Base

        original = F.linear
        on = {"zero_optimization": {"stage": 3, "memory_efficient_linear": True}}
        with ds_zero.Init(config_dict_or_path=on) as init:
            assert isinstance(init, Base) and init.mem_efficient_linear
            torch.nn.Linear(2, 2)
            assert F.linear is original, "entering Init"
        assert F.linear is original, "after Init"
        ds_zero.Init(module=torch.nn.Linear(3, 3), config_dict_or_path=on)
        assert F.linear is original, "Init(module=...)"
        model = torch.nn.Linear(3, 2)
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 3})
        assert F.linear is original, "the stage-3 optimizer"
        assert not hasattr(Base, "linear_bk")
        print("OK")
        """
    )
    _run_fresh(script)
