"""Domino on 2 gloo ranks (tensor-parallel degree 2): how much of the tensor-parallel all-reduce time the
half-batch overlap hides, against the same model without the split.

Model: `ds_parallel.domino.DominoTransformer`, `--layers` pre-LN blocks of hidden `--hidden` (heads of 64,
MLP 4x), activations `[--seq, --batch, hidden]` fp32. A step is forward + backward (no optimizer: Domino
changes neither). Modes, on the same weights and data:

- `plain`: `forward_without_overlap`, the whole batch per block, each all-reduce waited for at once (plain
  tensor parallelism; the baseline);
- `domino`: the inter-layer schedule (the default): two half-batches in turn, every all-reduce in flight
  while the other half computes;
- `domino_intra`: the intra-layer schedule (`domino_intra_layer_overlap`).

The modes take turns step by step (so machine load hits them alike); each figure is the median over
`--steps` after one warm-up round, worst rank. Each rank uses `--threads` intra-op threads; gloo's
collectives run on their own threads, which is what lets them overlap compute on a CPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace
from typing import Any

import _report
import torch

from ds_comm.testing import run_ranks

MODES = ("plain", "domino", "domino_intra")


class _Mpu:
    def get_tensor_model_parallel_world_size(self) -> int:
        return 2

    def get_tensor_model_parallel_group(self) -> Any:
        return torch.distributed.group.WORLD


def _config(hidden: int, layers: int, intra: bool) -> SimpleNamespace:
    return SimpleNamespace(
        hidden_size=hidden, ffn_hidden_size=4 * hidden, num_attention_heads=hidden // 64, kv_channels=64,
        num_layers=layers, layernorm_epsilon=1e-5, hidden_dropout=0.0, attention_dropout=0.0,
        add_bias_linear=True, init_method=lambda w: torch.nn.init.normal_(w, std=0.02),
        output_layer_init_method=lambda w: torch.nn.init.normal_(w, std=0.02), params_dtype=torch.float32,
        domino_intra_layer_overlap=intra,
    )  # fmt: skip


def _measure(rank: int, world: int, hidden: int, layers: int, seq: int, batch: int, steps: int, threads: int):
    from ds_parallel.domino import DominoTransformer, ModelType

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    models = {
        "domino": DominoTransformer(_config(hidden, layers, False), _Mpu(), None, ModelType.encoder_or_decoder),
        "domino_intra": DominoTransformer(_config(hidden, layers, True), _Mpu(), None, ModelType.encoder_or_decoder),
    }
    models["domino_intra"].load_state_dict(models["domino"].state_dict())
    runs = {
        "plain": lambda x: models["domino"].forward_without_overlap(x, None),
        "domino": lambda x: models["domino"](x, None),
        "domino_intra": lambda x: models["domino_intra"](x, None),
    }
    x = torch.randn(seq, batch, hidden, generator=torch.Generator().manual_seed(1))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for step in range(steps + 1):
        for mode in MODES:
            torch.distributed.barrier()
            start = time.perf_counter()
            runs[mode](x).square().mean().backward()
            elapsed = time.perf_counter() - start
            if step:
                times[mode].append(elapsed)
    return {m: statistics.median(t) for m, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--threads", type=int, default=1)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    if args.hidden % 64 or (args.hidden // 64) % 2 or args.batch < 2:
        parser.error("--hidden must be a multiple of 128 (heads of 64, split over 2 ranks) and --batch at least 2")
    ranks = run_ranks(
        2, _measure, args.hidden, args.layers, args.seq, args.batch, args.steps, args.threads, timeout_s=1800
    )
    res = {m: max(r[m] for r in ranks) for m in MODES}
    print(
        f"{args.layers} blocks, hidden {args.hidden}, seq {args.seq} x batch {args.batch}, fp32, tp 2 on 2 gloo ranks, "
        f"{args.threads} thread(s)/rank; forward + backward, median of {args.steps} (worst rank)"
    )
    print(f"{'mode':<14}{'step s':>9}{'vs plain':>10}")
    for mode in MODES:
        print(f"{mode:<14}{res[mode]:>9.3f}{res[mode] / res['plain']:>10.3f}")
    rows = [
        _report.Row("domino", f"step time, {mode} vs plain TP (no split), tp 2", res[mode], "s", "plain", res["plain"])
        for mode in ("domino", "domino_intra")
    ]
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
