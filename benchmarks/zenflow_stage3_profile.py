"""Where ZeRO-3 ZenFlow's step time goes, next to plain ZeRO-3 CPU offload (2 gloo ranks, rank 0's figures).

Run: python benchmarks/zenflow_stage3_profile.py [--steps 24]
Model, data and ZenFlow settings: benchmarks/zenflow.py's (`--stage 3`). Per mode: wall and CPU (process) time per
micro step (forward, backward, step; the first 2 steps left out), and per micro step the time spent in the
optimizer's parts (the stage-3 backward, the step, the re-gather of the parameters that stay whole, ZenFlow's
selective step, column choice and input attachment), with how many parameters and elements the re-gather moved:
the figures that say whether ZenFlow re-gathers more than plain ZeRO-3 does.
"""

from __future__ import annotations

import argparse
import collections
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import zenflow as bench  # noqa: E402


def _timed(cls: type, name: str, acc: dict[str, list[float]]) -> None:
    orig = getattr(cls, name)

    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return orig(self, *args, **kwargs)
        finally:
            acc[name][0] += time.perf_counter() - wall
            acc[name][1] += time.process_time() - cpu
            acc[name][2] += 1

    setattr(cls, name, run)


def _rank(rank: int, world: int, port: int, mode: str, steps: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    os.environ.update({"LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    from _gpt import GPT

    import ds_engine
    from ds_ops import ZenFlowSelectiveAdamW
    from ds_zero._schedule.coordinator import ParamCoordinator
    from ds_zero._stage3.optimizer import DeepSpeedZeroOptimizer_Stage3
    from ds_zero._zenflow.stage3 import ZenFlowZeroOptimizer_Stage3

    acc: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    moved = [0, 0]
    refresh = ParamCoordinator.refresh

    def counted(self: Any, params: list[Any], label: str) -> None:
        moved[0] += len(params)
        moved[1] += sum(int(p.ds_numel) for p in params)
        refresh(self, params, label)

    ParamCoordinator.refresh = counted  # type: ignore[method-assign]
    _timed(DeepSpeedZeroOptimizer_Stage3, "backward", acc)  # ZenFlow's backward calls it for the stage-3 part
    if mode == "zenflow":
        for name in ("refresh_gathered", "step", "_choose_columns", "_attach_selected"):
            _timed(ZenFlowZeroOptimizer_Stage3, name, acc)
        _timed(ZenFlowSelectiveAdamW, "group_step", acc)
    else:
        for name in ("refresh_gathered", "step"):
            _timed(DeepSpeedZeroOptimizer_Stage3, name, acc)
    ds_engine.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT(vocab=bench.VOCAB, width=256, layers=4, heads=4, block=bench.SEQ)
    engine, *_ = ds_engine.initialize(model=model, model_parameters=model.parameters(), config=bench._config(mode, 3))
    g = torch.Generator().manual_seed(100 + rank)
    wall = cpu = 0.0
    for i in range(steps):
        tokens = torch.randint(0, bench.VOCAB, (bench.BATCH, bench.SEQ + 1), generator=g)
        w0, c0 = time.perf_counter(), time.process_time()
        logits = engine(tokens[:, :-1])
        engine.backward(F.cross_entropy(logits.reshape(-1, bench.VOCAB), tokens[:, 1:].reshape(-1)))
        engine.step()
        if i >= 2:
            wall += time.perf_counter() - w0
            cpu += time.process_time() - c0
    if rank == 0:
        n = steps - 2
        print(f"{mode}: {1e3 * wall / n:.1f} ms wall, {1e3 * cpu / n:.1f} ms CPU per micro step (loaded host)")
        for name, (w, c, calls) in sorted(acc.items(), key=lambda kv: -kv[1][1]):
            print(
                f"  {name:18s} {calls:3d} calls  {1e3 * w / steps:7.1f} ms wall  {1e3 * c / steps:6.1f} ms CPU per step"
            )
        print(f"  re-gathered per micro step: {moved[0] / steps:.1f} parameters, {moved[1] / steps:,.0f} elements")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    for mode in ("offload", "zenflow"):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        mp.spawn(_rank, args=(2, port, mode, args.steps), nprocs=2, join=True)


if __name__ == "__main__":
    main()
