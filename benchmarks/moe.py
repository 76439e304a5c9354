"""DeepSpeed-MoE step time on 2 gloo ranks: MoE at ep_size 1 and 2 against a dense model of the same active
parameters, and the share of the MoE step spent in the expert all-to-alls.

Models: `--layers` blocks of (a mixer Linear + an MLP H -> 4H -> H). The dense model has one MLP per block;
the MoE models replace it by `MoE(num_experts=--experts, k=1)` over copies of that MLP, so each token still
runs one MLP (same active parameters, plus the gate). A step is forward + backward + `engine.step()` under
`ds_engine.initialize` (ZeRO stage 0, fp32, AdamW): for MoE that includes both all-to-alls each way and
the expert-data-parallel gradient all-reduce. Step time is the median over `--steps` after one warm-up step,
worst rank. The all-to-all time is measured around every exchange (forward and backward) of the step.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _report
import torch

from ds_comm.testing import run_ranks

MODES = {"dense": 0, "moe_ep1": 1, "moe_ep2": 2}  # name: expert-parallel size (0: no MoE)


def _mlp(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(), torch.nn.Linear(4 * hidden, hidden)
    )


class _Model(torch.nn.Module):
    def __init__(self, hidden: int, layers: int, experts: int, ep_size: int) -> None:
        super().__init__()
        from ds_parallel.moe import MoE

        self.mix = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(layers)])
        self.ffn = torch.nn.ModuleList(
            [
                _mlp(hidden)
                if ep_size == 0
                else MoE(hidden, _mlp(hidden), num_experts=experts, ep_size=ep_size, k=1, min_capacity=4)
                for _ in range(layers)
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = x.new_zeros(())
        for mix, ffn in zip(self.mix, self.ffn, strict=True):
            x = x + torch.tanh(mix(x))
            out = ffn(x)
            if isinstance(out, tuple):
                out, l_aux, _ = out
                aux = aux + l_aux
            x = x + out
        return x.square().mean() + 0.01 * aux


def _measure(rank: int, world: int, ep_size: int, hidden: int, layers: int, experts: int, tokens: int, steps: int):
    import ds_engine
    from ds_parallel.moe import _all_to_all

    torch.set_num_threads(1)
    spent = [0.0]
    exchange = _all_to_all._exchange

    def timed(x: torch.Tensor, group: Any) -> torch.Tensor:
        start = time.perf_counter()
        out = exchange(x, group)
        spent[0] += time.perf_counter() - start
        return out

    _all_to_all._exchange = timed
    torch.manual_seed(0)
    model = _Model(hidden, layers, experts, ep_size)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    engine, *_ = ds_engine.initialize(model=model, config=config)
    x = torch.randn(tokens // 128, 128, hidden, generator=torch.Generator().manual_seed(rank))
    times, shares = [], []
    for step in range(steps + 1):
        torch.distributed.barrier()
        spent[0] = 0.0
        start = time.perf_counter()
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        elapsed = time.perf_counter() - start
        if step:
            times.append(elapsed)
            shares.append(spent[0] / elapsed)
    active = sum(
        p.numel() for n, p in model.named_parameters() if "deepspeed_experts.0." in n or "deepspeed_experts" not in n
    )
    return {"step_s": statistics.median(times), "a2a_share": statistics.median(shares), "active_params": active}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--experts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=2048, help="tokens per rank per step (multiple of 128)")
    parser.add_argument("--steps", type=int, default=5)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    if args.tokens % 128:
        parser.error("--tokens must be a multiple of 128")
    res = {}
    for name, ep in MODES.items():
        ranks = run_ranks(
            2, _measure, ep, args.hidden, args.layers, args.experts, args.tokens, args.steps, timeout_s=1800
        )
        res[name] = {k: max(r[k] for r in ranks) for k in ranks[0]}
    print(
        f"{args.layers} blocks, hidden {args.hidden}, MLP 4x, {args.experts} experts top-1, {args.tokens} tokens/rank, "
        f"2 gloo ranks, fp32 AdamW, ZeRO 0; step = median of {args.steps} (worst rank)"
    )
    print(f"{'mode':<9}{'active params':>15}{'step s':>9}{'vs dense':>10}{'all-to-all':>12}")
    base = res["dense"]["step_s"]
    for name, r in res.items():
        share = f"{r['a2a_share']:.1%}" if MODES[name] else "-"
        print(f"{name:<9}{r['active_params']:>15,}{r['step_s']:>9.3f}{r['step_s'] / base:>10.2f}{share:>12}")
    rows = [
        _report.Row(
            "moe", f"step time, {name} vs dense of the same active params", res[name]["step_s"], "s", "dense", base
        )
        for name in ("moe_ep1", "moe_ep2")
    ]
    # ep_size 1 exchanges nothing (every rank holds every expert), so only ep 2 has a share.
    rows.append(
        _report.Row("moe", "all-to-all share of the moe_ep2 step (forward + backward)", res["moe_ep2"]["a2a_share"])
    )
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
