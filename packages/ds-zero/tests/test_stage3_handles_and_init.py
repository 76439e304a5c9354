"""`MultipleAllGatherHandles` forwards `handle_dependency` by keyword; `Init` initialises torch.distributed;
`Init` and stage 3 install DeepSpeed's stage-3 linear over `torch.nn.functional.linear`.

Under `memory_efficient_linear` (default true) an entered `Init`, `Init(module=...)` and the stage-3
parameter manager leave `F.linear is zero3_linear_wrap` for the rest of the process, keeping the original
as `InsertPostInitMethodToModuleSubClasses.linear_bk`, as DeepSpeed does. The Init checks run in a fresh
interpreter (the test process must not keep a process group, nor a patched `F.linear`).
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
def test_init_and_stage3_install_the_stage3_linear_as_deepspeed_does() -> None:
    script = textwrap.dedent(
        """
        import torch
        import torch.nn.functional as F
        import ds_zero
        from ds_zero import InsertPostInitMethodToModuleSubClasses as Base, zero3_linear_wrap

        original = F.linear
        off = {"zero_optimization": {"stage": 3, "memory_efficient_linear": False}}
        with ds_zero.Init(config_dict_or_path=off):
            torch.nn.Linear(2, 2)
        ds_zero.Init(module=torch.nn.Linear(3, 3), config_dict_or_path=off)
        model = torch.nn.Linear(3, 2)
        ds_zero.DeepSpeedZeroOptimizer_Stage3(
            model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 3, "memory_efficient_linear": False}
        )
        assert F.linear is original and not hasattr(Base, "linear_bk"), "memory_efficient_linear false: no install"

        with ds_zero.Init(enabled=False):
            assert F.linear is original
        on = {"zero_optimization": {"stage": 3, "memory_efficient_linear": True}}
        init = ds_zero.Init(config_dict_or_path=on)
        assert F.linear is original and not hasattr(Base, "linear_bk"), "constructing Init installs nothing"
        with init as entered:
            assert isinstance(entered, Base) and F.linear is zero3_linear_wrap
            with ds_zero.Init():
                assert F.linear is zero3_linear_wrap and Base.linear_bk is original
        assert F.linear is zero3_linear_wrap and Base.linear_bk is original, "persists after exit"

        F.linear = original  # reset by the user: the next partitioning installs it again, same backup
        ds_zero.Init(module=torch.nn.Linear(3, 3))
        assert F.linear is zero3_linear_wrap and Base.linear_bk is original

        def foreign(*args, **kwargs):
            return zero3_linear_wrap(*args, **kwargs)
        F.linear = foreign  # someone wrapped it: it stays
        model = torch.nn.Linear(3, 2)
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 3})
        assert F.linear is foreign and Base.linear_bk is original

        F.linear = original
        with ds_zero.Init():
            built = torch.nn.Linear(3, 2)  # already partitioned: the engine path does not install again
        F.linear = original
        ds_zero.DeepSpeedZeroOptimizer_Stage3(built, torch.optim.SGD(built.parameters(), lr=0.1), config={"stage": 3})
        assert F.linear is original, "a model built under Init: the optimizer converts nothing, installs nothing"
        model = torch.nn.Linear(3, 2)
        ds_zero.DeepSpeedZeroOptimizer_Stage3(model, torch.optim.SGD(model.parameters(), lr=0.1), config={"stage": 3})
        assert F.linear is zero3_linear_wrap, "the stage-3 optimizer partitioning a model installs it"
        print("OK")
        """
    )
    _run_fresh(script)


@pytest.mark.timeout(120)
def test_init_refuses_a_one_rank_world_under_a_multi_process_launcher() -> None:
    # The process group of one is up before Init (as from_pretrained leaves it); the launcher says 2.
    script = textwrap.dedent(
        """
        import os
        import torch, torch.distributed as dist
        import ds_zero
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["MASTER_PORT"],
                                rank=0, world_size=1)
        os.environ["WORLD_SIZE"] = "2"
        try:
            with ds_zero.Init():
                torch.nn.Linear(3, 2)
        except RuntimeError as err:
            assert "WORLD_SIZE=2" in str(err) and "init_distributed" in str(err), err
        else:
            raise AssertionError("Init partitioned across a world of 1 under WORLD_SIZE=2")
        with ds_zero.Init(enabled=False):  # a disabled Init partitions nothing: nothing to refuse
            torch.nn.Linear(3, 2)
        with ds_zero.Init(data_parallel_group=dist.new_group([0])):  # a group of one asked for explicitly
            layer = torch.nn.Linear(3, 2)
        assert layer.weight.ds_status is ds_zero.ZeroParamStatus.NOT_AVAILABLE
        print("OK")
        """
    )
    _run_fresh(script)
