"""Ulysses sequence parallelism (ALST) on a tiny Hugging Face Llama: activation memory per rank and step time
vs sequence length, at SP=1 (plain SDPA, one process) and SP=2/4 (gloo ranks), plus SP=2 with TiledMLP.

Activation memory is what autograd keeps for backward during one forward (bytes of the distinct tensors
saved through `torch.autograd.graph.saved_tensors_hooks`, parameters excluded): the memory that grows
with the sequence. Peak RSS per rank (whole process: torch, transformers, the model) is printed next to
it. A step is forward + SP loss aggregation + backward + the gradient all-reduce over the SP group +
an SGD update; its time is the median over `--steps` after one warm-up step, worst rank.

Targets: activation memory per rank at SP=2 <= 0.6x SP=1's at the longest length; the longest sequence
whose activations fit the budget SP=1 needs at the longest measured length grows >= 1.8x at SP=2
(activations are linear in the length with SDPA's flash kernel, so the fit through the measured points
gives that length). Writes `ulysses.svg` (the curves) next to this file, or under `--out-dir`.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from pathlib import Path
from typing import Any

import _report
import _svg_plot
import torch

from ds_comm.testing import run_ranks

VOCAB, HIDDEN, INNER, LAYERS, HEADS = 1024, 128, 512, 2, 4
MODES = {"sp1": (1, 1), "sp2": (2, 1), "sp4": (4, 1), "sp2_tiled": (2, 4)}  # name: (SP degree, MLP tiles)


def _config(max_len: int) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INNER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        max_position_embeddings=max_len,
        tie_word_embeddings=False,
    )


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _measure(rank: int, world: int, seq: int, tiles: int, steps: int) -> dict[str, float]:
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ds_parallel.ulysses_sp import TiledMLP, UlyssesSPAttentionHF, aggregate_sp_loss

    torch.set_num_threads(1)
    config = _config(seq)
    if world > 1:
        mpu = UlyssesSPAttentionHF.register_with_transformers(config, "sdpa", world, micro_batch_size=1, seq_length=seq)
        group = mpu.get_sequence_parallel_group()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="ulysses" if world > 1 else "sdpa", dtype=torch.float32
    )
    if tiles > 1:
        for layer in model.model.layers:
            mlp = layer.mlp
            untiled = type(mlp).forward
            mlp.forward = lambda x, mlp=mlp, untiled=untiled: TiledMLP.apply(untiled, mlp, x, tiles, None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (1, seq), generator=torch.Generator().manual_seed(1))
    shift = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    lo, hi = rank * seq // world, (rank + 1) * seq // world
    batch = {
        "input_ids": ids[:, lo:hi],
        "position_ids": torch.arange(lo, hi).view(1, -1),
        "labels": ids[:, lo:hi],
        "shift_labels": shift[:, lo:hi],
    }
    params = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    rss_before = _rss_mib()
    times = []
    for step in range(steps + 1):
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(**batch, use_cache=False).loss
            if world > 1:
                loss = aggregate_sp_loss(loss, batch["shift_labels"], group)
        activation = sum(saved.values())
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad, group=group)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "activation_mib": activation / 2**20,
        "step_s": statistics.median(times),
        "peak_rss_mib": peak,
        "rss_growth_mib": peak - rss_before,
    }


def _fit_longest(lengths: list[int], mib: list[float], budget: float) -> float:
    """The length at which the least-squares line through (length, MiB) reaches `budget`."""
    n = len(lengths)
    mx, my = sum(lengths) / n, sum(mib) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(lengths, mib, strict=True)) / sum((x - mx) ** 2 for x in lengths)
    return (budget - (my - slope * mx)) / slope


def _plot(lengths: list[int], res: dict[str, dict[int, dict[str, float]]]) -> str:
    mem = _svg_plot.Panel(
        "activation memory per rank",
        "sequence length (tokens)",
        "MiB",
        [_svg_plot.Series(m, lengths, [res[m][n]["activation_mib"] for n in lengths]) for m in res],
    )
    step = _svg_plot.Panel(
        "step time (worst rank)",
        "sequence length (tokens)",
        "s",
        [_svg_plot.Series(m, lengths, [res[m][n]["step_s"] for n in lengths]) for m in res],
    )
    return _svg_plot.render([mem, step], title=f"Ulysses SP on a {LAYERS}-layer Llama (hidden {HIDDEN}), fp32, CPU")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    modes = args.modes.split(",")
    if "sp1" not in modes or any(m not in MODES for m in modes):
        parser.error(f"--modes {args.modes!r}: choose from {list(MODES)}, including sp1")
    if any(n % 4 for n in lengths):
        parser.error("--lengths must be multiples of 4 (each SP rank takes an equal shard)")
    res: dict[str, dict[int, dict[str, float]]] = {m: {} for m in modes}
    for n in lengths:
        for m in modes:
            world, tiles = MODES[m]
            ranks = run_ranks(world, _measure, n, tiles, args.steps, timeout_s=1800)
            res[m][n] = {k: max(r[k] for r in ranks) for k in ranks[0]}
    print(
        f"Llama {LAYERS} layers, hidden {HIDDEN}, MLP {INNER}, {HEADS} heads, vocab {VOCAB}, fp32, batch 1; "
        f"activation = tensors saved for backward per rank; step = median of {args.steps} (worst rank)"
    )
    print(
        f"{'tokens':>7} {'mode':<10}{'act MiB':>10}{'act/SP1':>9}{'step s':>9}{'step/SP1':>9}{'peak RSS':>10}"
        f"{'RSS growth':>11}"
    )
    for n in lengths:
        base = res["sp1"][n]
        for m in modes:
            r = res[m][n]
            print(
                f"{n:>7} {m:<10}{r['activation_mib']:>10.1f}{r['activation_mib'] / base['activation_mib']:>9.3f}"
                f"{r['step_s']:>9.3f}{r['step_s'] / base['step_s']:>9.3f}{r['peak_rss_mib']:>10.0f}"
                f"{r['rss_growth_mib']:>11.0f}"
            )
    longest = lengths[-1]
    budget = res["sp1"][longest]["activation_mib"]
    rows = []
    for m in modes:
        r, base = res[m][longest], res["sp1"][longest]
        if m != "sp1":
            rows.append(
                _report.Row(
                    "ulysses",
                    f"activation memory per rank, {m} vs sp1, {longest} tokens",
                    r["activation_mib"],
                    "MiB",
                    "sp1",
                    base["activation_mib"],
                    target="<= 0.6" if m == "sp2" else "",
                )
            )
            rows.append(
                _report.Row(
                    "ulysses",
                    f"step time (worst rank), {m} vs sp1, {longest} tokens",
                    r["step_s"],
                    "s",
                    "sp1",
                    base["step_s"],
                )
            )
        if len(lengths) > 1:
            fits = _fit_longest(lengths, [res[m][n]["activation_mib"] for n in lengths], budget)
            growth = fits / _fit_longest(lengths, [res["sp1"][n]["activation_mib"] for n in lengths], budget)
            print(
                f"{m}: the activations of sp1 at {longest} tokens ({budget:.0f} MiB) fit up to {fits:.0f} tokens "
                f"({growth:.2f}x sp1's)"
            )
            if m != "sp1":
                rows.append(
                    _report.Row(
                        "ulysses",
                        f"longest sequence within sp1's activation budget at {longest} "
                        f"tokens ({budget:.0f} MiB), {m} / sp1 (linear fit)",
                        growth,
                        target=">= 1.8" if m == "sp2" else "",
                    )
                )
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "ulysses.svg").write_text(_plot(lengths, res))
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
