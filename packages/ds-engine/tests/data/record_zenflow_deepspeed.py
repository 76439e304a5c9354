"""Record DeepSpeed 0.19.8's ZenFlow runs (`zenflow_case.RUNS`) into `zenflow_deepspeed.json`.

    DS_ACCELERATOR=cpu /path/to/deepspeed-0.19.8-venv/bin/python record_zenflow_deepspeed.py [NAME ...]

Runs each case of `../zenflow_case.py` under the real `deepspeed` package on CPU with gloo (one process per
rank, spawned here; names on the command line run only those cases and keep the others' records), and
writes every rank's per-step losses and final parameter norms, twice per case:

- `NAME`: DeepSpeed 0.19.8 as released. Its stage-1/2 ZenFlow flattens each 2-D weight transposed
  (column after column), but `_update_model_bit16_weights` then views the flat buffer row-major with the
  weight's shape, so the model trains from a reshuffled copy of its initial weights, and the CPU
  optimizer's gradient (kept in the transposed order) lands on other elements than the ones it belongs to;
- `NAME+view_fix`: the same with that one method restored to view the buffer through ZenFlow's own
  unflatten (transposed back, as DeepSpeed's earlier releases did), so weights and gradients line up.
  These are the numbers ds's ZenFlow is compared with (`dist/test_dist_zenflow.py`).

With `overlap_step`, DeepSpeed's result depends on its worker's speed: at a reselection it resets the fp32
masters from the model while its worker process may still be updating them (three runs of `z2_w2_overlap`
on this host gave three trajectories from the first window after the reselection on, up to 1e-2 apart).
So the `+view_fix` record of an overlap case is made with the worker kept up (`_keep_up`: the training
process sleeps 0.3 s after each submit, far longer than this model's update), which makes it repeatable
and is the result ds's overlap gives by design (it waits for its worker before touching the masters).

Run it without ds on the path: it must import DeepSpeed's own package.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import tempfile
from pathlib import Path

import torch
import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import zenflow_case as case  # noqa: E402

VIEW_FIX = "+view_fix"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _fix_bit16_views() -> None:
    """View each 2-D weight through ZenFlow's unflatten (transposed back) instead of row-major."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    released = DeepSpeedZeroOptimizer._update_model_bit16_weights

    def update(self, group_index):  # type: ignore[no-untyped-def]
        if not getattr(self, "zenflow", False):
            return released(self, group_index)
        views = self.unflatten(self.bit16_groups_flat[group_index], self.round_robin_bit16_meta[group_index])
        for p, q in zip(self.round_robin_bit16_groups[group_index], views, strict=True):
            p.data = q.data
        for param_index, param in enumerate(self.bit16_groups[group_index]):
            param.data = self.round_robin_bit16_groups[group_index][
                self.round_robin_bit16_indices[group_index][param_index]
            ].data

    DeepSpeedZeroOptimizer._update_model_bit16_weights = update


def _keep_up() -> None:
    """Let DeepSpeed's ZenFlow worker finish each update before training goes on (module note)."""
    import time

    from deepspeed.runtime.zenflow.zenflow_stage_1_and_2 import ZenFlowZeroOptimizerParallel

    submit = ZenFlowZeroOptimizerParallel.zenflow_cpu_optimizer_step

    def step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        submit(self, *args, **kwargs)
        time.sleep(0.3)

    ZenFlowZeroOptimizerParallel.zenflow_cpu_optimizer_step = step


def _rank(rank: int, world: int, port: int, name: str, fix: bool, out: str) -> None:
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    )
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import deepspeed

    if fix:
        _fix_bit16_views()
        if case.RUNS[name][2].get("overlap_step"):
            _keep_up()
    deepspeed.init_distributed(dist_backend="gloo")
    result = case.train(deepspeed, rank, world, name)
    torch.save(result, f"{out}.{rank}")


def main() -> None:
    import deepspeed

    results: dict[str, object] = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__}
    tmp = Path(tempfile.mkdtemp()) / "rank"
    for name, (world, *_rest) in case.RUNS.items():
        if len(sys.argv) > 1 and name not in sys.argv[1:]:
            continue
        for fix in (False, True):
            mp.spawn(_rank, args=(world, _free_port(), name, fix, str(tmp)), nprocs=world, join=True)
            results[name + (VIEW_FIX if fix else "")] = [torch.load(f"{tmp}.{r}") for r in range(world)]
            for r in range(world):
                os.remove(f"{tmp}.{r}")
    out = HERE / "zenflow_deepspeed.json"
    if out.exists():  # a partial run (names on the command line) keeps the other cases
        results = {**json.loads(out.read_text()), **results}
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
