"""Model-state bytes per parameter with bf16 master weights, gradients and optimizer states, measured per rank.

    python benchmarks/bf16_masters.py [--hidden 512] [--layers 4] [--json out.json]

ZeRO-3 on 2 gloo ranks (every model state is partitioned, so a rank's bytes over its share of the parameters is
the cost of one parameter), a bf16 model trained with AdamW, one run per mode: fp32 masters (the default),
`bf16.bf16_master_weights_and_grads` + `bf16.bf16_optimizer_states`, and the same with the optimizer offloaded to
the CPU (DeepSpeedCPUAdam), with bf16 or with fp32 moments. Inside the second step, just before the base
optimizer steps, every tensor that holds model state on the rank is collected: the bf16 parameter shards, the
base optimizer's parameters (the masters), their gradients (the reduced gradient partitions) and the optimizer's
state tensors (exp_avg, exp_avg_sq). Their storages are deduplicated (a master that is a view of the shard counts
once) and their allocated bytes summed: measured from the tensors the run holds, not computed from a formula.
Host buffers of the CPU offload live in transparent huge pages (ds_ops.host_memory), allocated in whole 2 MiB
pages: at this size (8.4 MiB of bf16 moments per rank, rounded up to 10) that shows as +0.5 B per moment.
"""

from __future__ import annotations

import argparse
from typing import Any

import _report
import torch
from torch import nn

from ds_comm.testing import run_ranks

MODES: dict[str, dict[str, Any]] = {
    "fp32 masters": {},
    "bf16 masters + states": {"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True},
    "bf16 masters + states, CPU offload": {
        "bf16_master_weights_and_grads": True,
        "bf16_optimizer_states": True,
        "offload": True,
    },
    "bf16 masters, fp32 states, CPU offload": {"bf16_master_weights_and_grads": True, "offload": True},
}


def _model(hidden: int, layers: int) -> nn.Module:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden)]
    return nn.Sequential(*blocks)


def _storages(tensors: list[torch.Tensor], seen: dict[int, int]) -> int:
    """Add each tensor's storage to `seen` (data pointer -> allocated bytes); the bytes newly added."""
    added = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen and storage.nbytes():
            seen[storage.data_ptr()] = storage.nbytes()
            added += storage.nbytes()
    return added


def _measure(rank: int, world: int, mode: str, hidden: int, layers: int) -> dict[str, Any]:
    import ds_engine

    opts = dict(MODES[mode])
    offload = opts.pop("offload", False)
    zero: dict[str, Any] = {"stage": 3, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "bf16": {"enabled": True, **opts},
        "zero_optimization": zero,
    }
    torch.manual_seed(0)
    model = _model(hidden, layers)
    numel = sum(p.numel() for p in model.parameters())
    engine, *_ = ds_engine.initialize(model=model, model_parameters=model.parameters(), config=config)
    base = engine.optimizer.optimizer
    found: dict[str, int] = {}

    def collect() -> None:
        seen: dict[int, int] = {}
        shards = [p.ds_tensor for p in engine.module.parameters()]
        masters = [p for g in base.param_groups for p in g["params"]]
        found["param"] = _storages(shards, seen)
        found["master"] = _storages(masters, seen)
        found["grad"] = _storages([p.grad for p in masters if p.grad is not None], seen)
        for key in ("exp_avg", "exp_avg_sq"):
            found[key] = _storages([st[key] for st in base.state.values() if key in st], seen)

    original = base.step

    def step(*args: Any, **kwargs: Any) -> Any:
        if base.state:  # the second step: the moments exist
            collect()
        return original(*args, **kwargs)

    base.step = step  # type: ignore[method-assign]
    x = torch.randn(2, hidden, dtype=torch.bfloat16)
    for _ in range(2):
        engine.backward(engine(x).float().square().mean())
        engine.step()
    found["elements"] = numel // world
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    keys = ("param", "master", "grad", "exp_avg", "exp_avg_sq")
    print(f"ZeRO-3, 2 gloo ranks, bf16 model of {args.layers} MLP blocks (hidden {args.hidden}), AdamW")
    print(f"{'mode':<42}" + "".join(f"{k:>11}" for k in keys) + f"{'total B/param':>15}")
    per_param: dict[str, float] = {}
    for mode in MODES:
        res = max(run_ranks(2, _measure, mode, args.hidden, args.layers, timeout_s=600), key=lambda r: r["param"])
        n = res["elements"]
        per_param[mode] = sum(res[k] for k in keys) / n
        print(f"{mode:<42}" + "".join(f"{res[k] / n:>11.2f}" for k in keys) + f"{per_param[mode]:>15.2f}")
    base = per_param["fp32 masters"]
    rows = [_report.Row("bf16_masters", "model-state bytes/param, fp32 masters", base, "B")]
    targets = {"bf16 masters + states": "<= 8 B", "bf16 masters + states, CPU offload": "<= 8 B"}
    for mode in list(MODES)[1:]:
        figure = f"model-state bytes/param, {mode}"
        rows.append(
            _report.Row(
                "bf16_masters", figure, per_param[mode], "B", "fp32 masters", base, target=targets.get(mode, "")
            )
        )
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
