"""The hybrid engine's generate() under ZeRO-3 on 2 gloo ranks: tokens/s against the plain ZeRO-3 model's
`generate` (every layer gathered again for every token) and against the unpartitioned model on one rank.

Model: a Hugging Face Llama built from a config (`--hidden`, `--layers`, vocabulary 2048, fp32, eager
attention). Each rank generates `--new-tokens` greedy tokens for `--batch` prompts of 16 tokens (its own
prompts; no end-of-sequence stop, so every rank runs the same number of forwards). Modes:

* `zero3_plain`: `ds_engine.initialize` at ZeRO stage 3 without the hybrid engine; `engine.module.generate`
  runs under the stage-3 hooks, which gather and release each module's parameters for every token;
* `hybrid`: the same with `"hybrid_engine": {"enabled": true}`; `engine.generate` gathers every parameter
  once per call and generates with the hooks off;
* `unpartitioned`: the plain model's `generate` in a world of one (the ceiling: no gather at all).

ZeRO-3 keeps parameters under `stage3_param_persistence_threshold` elements whole; at this model size the
default (1e5) would keep most matrices whole, so the threshold is 2 x hidden: the norm weights persist and
every matrix is partitioned, as in a model of billions of parameters with the default.

Tokens/s = batch x new tokens / wall time of one generate() call, the median over `--reps` calls after
a warm-up call, the slowest rank. The parameter gathers per call come from ds-zero's counter. The
one-rank run has the host's cores to itself while the two ranks share them, so on a host with fewer
cores than 2 x threads the unpartitioned figure is the better-placed one.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import _report
import torch

from ds_comm.testing import run_ranks

VOCAB = 2048
PROMPT = 16


def _model(hidden: int, layers: int) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager").float()


def _measure(rank: int, world: int, mode: str, hidden: int, layers: int, batch: int, new: int, reps: int):
    import ds_engine

    model = _model(hidden, layers)
    gathers = None
    if mode == "unpartitioned":
        generate = model.eval().generate
    else:
        config = {
            "train_micro_batch_size_per_gpu": batch,
            # the norm weights persist (as in a large model, where they are far below the default threshold
            # and every matrix above it); the matrices are partitioned
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 2 * hidden},
            "hybrid_engine": {"enabled": mode == "hybrid"},
        }
        engine, *_ = ds_engine.initialize(model=model, config=config)
        engine.eval()
        generate = engine.generate if mode == "hybrid" else engine.module.generate
        gathers = model._ds_zero3
    ids = torch.randint(0, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(rank))
    kwargs = {"max_new_tokens": new, "do_sample": False, "eos_token_id": None, "pad_token_id": 0}
    times, per_call = [], 0
    for rep in range(reps + 1):
        if world > 1:
            torch.distributed.barrier()
        before = gathers.num_param_gathers if gathers is not None else 0
        start = time.perf_counter()
        out = generate(ids, **kwargs)
        elapsed = time.perf_counter() - start
        assert out.shape == (batch, PROMPT + new)
        if rep:
            times.append(elapsed)
            per_call = gathers.num_param_gathers - before if gathers is not None else 0
    return {
        "tok_s": batch * new / statistics.median(times),
        "gathers": per_call,
        "params": sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
        "tensors": len(list(model.parameters())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    res = {}
    for mode, world in (("zero3_plain", 2), ("hybrid", 2), ("unpartitioned", 1)):
        ranks = run_ranks(
            world, _measure, mode, args.hidden, args.layers, args.batch, args.new_tokens, args.reps, timeout_s=900
        )
        res[mode] = {
            "tok_s": min(r["tok_s"] for r in ranks),
            "gathers": ranks[0]["gathers"],
            "params": ranks[0]["params"],
            "tensors": ranks[0]["tensors"],
        }
    print(
        f"Llama {args.layers} layers, hidden {args.hidden}, vocab {VOCAB}, {res['hybrid']['params']:,} params "
        f"({res['hybrid']['tensors']} tensors), fp32; {args.batch} prompts x {PROMPT} tokens per rank, "
        f"{args.new_tokens} greedy new tokens; median of {args.reps} calls, slowest rank"
    )
    print(f"{'mode':<15}{'ranks':>6}{'tokens/s':>11}{'vs zero3_plain':>16}{'gathers/call':>14}")
    base = res["zero3_plain"]["tok_s"]
    for mode, world in (("zero3_plain", 2), ("hybrid", 2), ("unpartitioned", 1)):
        r = res[mode]
        gathers = f"{r['gathers']:,}" if mode != "unpartitioned" else "-"
        print(f"{mode:<15}{world:>6}{r['tok_s']:>11.1f}{r['tok_s'] / base:>16.2f}{gathers:>14}")
    rows = [
        _report.Row(
            "hybrid_engine",
            "generate tokens/s per rank, ZeRO-3 2 ranks: engine.generate vs engine.module.generate (per-layer gathers)",
            res["hybrid"]["tok_s"],
            "tok/s",
            "ZeRO-3 hooks",
            base,
            target=">= 3",
        ),
        _report.Row(
            "hybrid_engine",
            "generate tokens/s per rank, ZeRO-3 2 ranks engine.generate vs the unpartitioned model on 1 rank",
            res["hybrid"]["tok_s"],
            "tok/s",
            "unpartitioned, 1 rank",
            res["unpartitioned"]["tok_s"],
        ),
        _report.Row(
            "hybrid_engine",
            "parameter gathers per generate call, engine.generate (each partitioned parameter once)",
            res["hybrid"]["gathers"],
            "",
            "engine.module.generate",
            res["zero3_plain"]["gathers"],
        ),
    ]
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
