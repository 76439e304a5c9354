"""Record DeepSpeed 0.19.8's bf16-master runs (`bf16_master_case.RUNS`) into `bf16_master_deepspeed.json`.

    DS_ACCELERATOR=cpu /path/to/deepspeed-0.19.8-venv/bin/python record_bf16_master_deepspeed.py [RUN ...]

Runs each case of `../bf16_master_case.py` under the real `deepspeed` package on CPU with gloo (one process per
rank, spawned here) and writes every rank's per-step losses, or the error DeepSpeed raised for the combination.
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

import bf16_master_case as case  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, name: str, out: str) -> None:
    os.environ.update(
        {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world)}
    )
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        result = case.train(deepspeed, rank, world, name)
    except (AssertionError, ValueError, RuntimeError) as err:  # a combination DeepSpeed refuses: its message
        result = {"error": f"{type(err).__name__}: {err}"}
    torch.save(result, f"{out}.{rank}")


def main() -> None:
    import deepspeed

    target = HERE / "bf16_master_deepspeed.json"
    results = json.loads(target.read_text()) if target.exists() else {}
    results.update({"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__})
    tmp = Path(tempfile.mkdtemp()) / "rank"
    for name in sys.argv[1:] or list(case.RUNS):
        mp.spawn(_rank, args=(case.WORLD, _free_port(), name, str(tmp)), nprocs=case.WORLD, join=True)
        results[name] = [torch.load(f"{tmp}.{r}") for r in range(case.WORLD)]
        for r in range(case.WORLD):
            os.remove(f"{tmp}.{r}")
        target.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
