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
Host buffers (CPU masters, the CPU Adam's moments) live in transparent huge pages (ds_ops.host_memory): the
allocator reserves up to one 2 MiB page more per buffer to align it, never touched; that slack is reported
beside the figures (its own column), not in them.
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
        blocks += [nn.Linear(hidden, 4 * hidden, bias=False), nn.GELU(), nn.Linear(4 * hidden, hidden, bias=False)]
    return nn.Sequential(*blocks)


def _storages(tensors: list[torch.Tensor], seen: dict[int, int], slack: list[int]) -> int:
    """Add each tensor's storage to `seen` (data pointer -> bytes); the bytes newly added.

    A storage counts the span its tensors cover (a master viewing its shard's storage adds nothing); what the
    allocator reserved beyond that (the alignment slack of a huge-page buffer) is added to `slack[0]`."""
    added = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() in seen or not storage.nbytes():
            continue
        used = t.numel() * t.element_size()
        seen[storage.data_ptr()] = used
        slack[0] += storage.nbytes() - used
        added += used
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
        slack = [0]
        # the shards of one partition are views of its flat bf16 buffer: count the buffer once, whole
        shards = [p.ds_tensor for p in engine.module.parameters()]
        flats = {s.untyped_storage().data_ptr(): s for s in shards}
        found["param"] = sum(s.untyped_storage().nbytes() for s in flats.values())
        seen.update({ptr: s.untyped_storage().nbytes() for ptr, s in flats.items()})
        masters = [p for g in base.param_groups for p in g["params"]]
        found["master"] = _storages(masters, seen, slack)
        found["grad"] = _storages([p.grad for p in masters if p.grad is not None], seen, slack)
        for key in ("exp_avg", "exp_avg_sq"):
            found[key] = _storages([st[key] for st in base.state.values() if key in st], seen, slack)
        found["slack"] = slack[0]

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
    print(f"ZeRO-3, 2 gloo ranks, bf16 model of {args.layers} bias-free MLP blocks (hidden {args.hidden}), AdamW")
    print(f"{'mode':<42}" + "".join(f"{k:>11}" for k in keys) + f"{'total B/param':>15}{'align slack MiB':>17}")
    per_param: dict[str, float] = {}
    for mode in MODES:
        res = max(run_ranks(2, _measure, mode, args.hidden, args.layers, timeout_s=600), key=lambda r: r["param"])
        n = res["elements"]
        per_param[mode] = sum(res[k] for k in keys) / n
        cells = "".join(f"{res[k] / n:>11.2f}" for k in keys)
        print(f"{mode:<42}{cells}{per_param[mode]:>15.2f}{res['slack'] / 2**20:>17.1f}")
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
