"""Record DeepSpeed 0.19.8's LoRA runs (`linear_lora_case.RUNS`) into `linear_lora_deepspeed.json`.

    DS_ACCELERATOR=cpu /path/to/deepspeed-0.19.8-venv/bin/python record_linear_lora_deepspeed.py

Runs each case of `../linear_lora_case.py` under the real `deepspeed` package on CPU with gloo (one
process per rank, spawned here), and writes every rank's per-step losses and final norms. Run it
without ds on the path: it must import DeepSpeed's own package.
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

import linear_lora_case as case  # noqa: E402


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
    world_size, sharding, stage, init = case.RUNS[name]
    result = case.train(deepspeed, rank, world, sharding, stage, init)
    torch.save(result, f"{out}.{rank}")


def main() -> None:
    import deepspeed

    results: dict[str, object] = {"deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__}
    tmp = Path(tempfile.mkdtemp()) / "rank"
    for name, (world, *_rest) in case.RUNS.items():
        mp.spawn(_rank, args=(world, _free_port(), name, str(tmp)), nprocs=world, join=True)
        results[name] = [torch.load(f"{tmp}.{r}") for r in range(world)]
        for r in range(world):
            os.remove(f"{tmp}.{r}")
    (HERE / "linear_lora_deepspeed.json").write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
