"""FPDT vs Ulysses alone at SP=2 (2 gloo ranks): the longest trainable sequence within a fixed memory budget.

The model: a 2-layer GPT (pre-LayerNorm, causal attention, GELU FFN 4x, an LM head with cross entropy over
a vocabulary 8x the hidden size), fp32, batch 1, no activation checkpointing. Two ways to run it:

- `ulysses`: `DistributedAttention` around `F.scaled_dot_product_attention` (its flash kernel on CPU), the
  FFN and the loss over the whole local sequence (`[tokens, vocab]` logits).
- `fpdt`: `FPDT_Attention` (global chunks of `--chunk` tokens), `FPDT_FFN` and `FPDT_LogitsLoss` over the
  same chunks.

Memory per rank after one forward (the worst rank):
- device: what the step keeps for backward on the compute device: the distinct tensors autograd saves
  (`saved_tensors_hooks`, parameters excluded) plus FPDT's chunks where they stay on the device;
- host: FPDT's chunks (`SequenceChunk`) that live in host memory when the model runs on an accelerator with
  offloading on (the default). This CPU-only host has no separate device memory: the chunks stay in the
  same RAM and FPDT's offload copies nothing, so the split is what an accelerator run holds where, counted
  from the same tensors;
- peak RSS growth over the step (the whole process, everything) is printed beside them.

Neither figure counts the transients of backward: for ulysses the `[tokens, vocab]` gradient of the logits
among others, for FPDT the attention output's and the queries' gradients of the whole local sequence, which
its backward holds on the device while it walks the key chunks.

The budget is ulysses' device memory at its longest measured length; the longest sequence within it comes
from the least-squares line through each mode's measured points (memory is linear in the length for both:
no `[seq, seq]` matrix exists in either), and FPDT is then run at that length to check it fits.
Target: FPDT's longest >= 4x ulysses'. Also prints the step time (forward + backward, median, worst rank).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from types import SimpleNamespace
from typing import Any

import _report
import torch

from ds_comm.testing import run_ranks

HIDDEN, HEADS, LAYERS, VOCAB = 128, 4, 2, 1024
INNER = 4 * HIDDEN


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _params(gen: torch.Generator) -> dict[str, Any]:
    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * shape[-1] ** -0.5).requires_grad_()

    layers = [
        {
            "w_qkv": w(3 * HIDDEN, HIDDEN),
            "b_qkv": torch.zeros(3 * HIDDEN, requires_grad=True),
            "w_out": w(HIDDEN, HIDDEN),
            "w1": w(INNER, HIDDEN),
            "b1": torch.zeros(INNER, requires_grad=True),
            "w2": w(HIDDEN, INNER),
            "b2": torch.zeros(HIDDEN, requires_grad=True),
        }
        for _ in range(LAYERS)
    ]
    return {"embed": w(VOCAB, HIDDEN), "head": w(VOCAB, HIDDEN), "layers": layers}


def _ulysses_loss(p: dict[str, Any], ids: torch.Tensor, labels: torch.Tensor, group: Any, world: int) -> torch.Tensor:
    import torch.nn.functional as F

    from ds_parallel import DistributedAttention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True).permute(2, 0, 1, 3)

    attn = DistributedAttention(sdpa, group, scatter_idx=2, gather_idx=0)
    x = p["embed"][ids].transpose(0, 1)  # [s, 1, h]
    for lp in p["layers"]:
        h = F.layer_norm(x, (HIDDEN,))
        q, k, v = F.linear(h, lp["w_qkv"], lp["b_qkv"]).unflatten(-1, (3, HEADS, -1)).unbind(2)
        x = x + attn(q, k, v, 1).flatten(2) @ lp["w_out"].t()
        h = F.layer_norm(x, (HIDDEN,))
        x = x + F.linear(F.gelu(F.linear(h, lp["w1"], lp["b1"]), approximate="tanh"), lp["w2"], lp["b2"])
    logits = F.linear(F.layer_norm(x, (HIDDEN,)), p["head"])
    return F.cross_entropy(logits.flatten(0, 1), labels.t().flatten(), reduction="sum") / (labels.numel() * world)


def _fpdt_loss(
    p: dict[str, Any], ids: torch.Tensor, labels: torch.Tensor, group: Any, rank: int, world: int, chunk: int
) -> torch.Tensor:
    import torch.nn.functional as F

    from ds_parallel.sequence import FPDT_FFN, FPDT_Attention, FPDT_LogitsLoss

    cfg = SimpleNamespace(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        kv_channels=HIDDEN // HEADS,
        attention_dropout=0.0,
    )
    x = p["embed"][ids].transpose(0, 1)
    n_chunks = x.shape[0] * world // chunk
    for lp in p["layers"]:
        attn = FPDT_Attention(cfg, lp["w_qkv"], lp["b_qkv"], lp["w_out"], None, group, chunk_size=chunk)
        x = x + attn(F.layer_norm(x, (HIDDEN,)))[0]
        out, _ = FPDT_FFN.apply(
            F.layer_norm(x, (HIDDEN,)), lp["w1"], lp["b1"], lp["w2"], lp["b2"], True, x.shape[0] // n_chunks
        )
        x = x + out
    loss = FPDT_LogitsLoss.apply(F.layer_norm(x, (HIDDEN,)), labels, p["head"], rank, world, group, n_chunks)
    return loss.mean()


def _fpdt_chunk_bytes(loss: torch.Tensor) -> tuple[int, int]:
    """(bytes of FPDT chunks kept on the device, bytes kept in host memory on an accelerator run)."""
    on_device = on_host = 0
    seen, todo = set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        for chunks in getattr(node, "chunks", None) or ():
            for c in chunks:
                nbytes = c.chunk_shape.numel() * c.chunk_dtype.itemsize
                if c.offloaded or c.cpu_chunk.device.type == "cpu":
                    # offloaded; on a CPU-only run the chunk is where an accelerator run would hold its host copy
                    on_host += nbytes
                else:
                    on_device += nbytes
        todo.extend(n for n, _ in node.next_functions)
    return on_device, on_host


def _measure(rank: int, world: int, mode: str, seq: int, chunk: int, steps: int) -> dict[str, float]:
    import torch.distributed as dist

    from ds_parallel.sequence._fpdt import fpdt_token_order

    torch.set_num_threads(1)
    group = dist.group.WORLD
    gen = torch.Generator().manual_seed(0)
    p = _params(gen)
    ids = torch.randint(0, VOCAB, (1, seq), generator=gen)
    labels = torch.roll(ids, -1, dims=1)
    if mode == "fpdt":
        order = fpdt_token_order(seq, chunk, world, rank)
    else:
        order = torch.arange(rank * seq // world, (rank + 1) * seq // world)
    params = {
        t.untyped_storage().data_ptr() for t in [p["embed"], p["head"]] + [t for lp in p["layers"] for t in lp.values()]
    }
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    times, device, host = [], 0, 0
    rss_before = _rss_mib()
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if mode == "fpdt":
                loss = _fpdt_loss(p, ids[:, order], labels[:, order], group, rank, world, chunk)
            else:
                loss = _ulysses_loss(p, ids[:, order], labels[:, order], group, world)
        chunk_dev, host = _fpdt_chunk_bytes(loss)
        device = sum(saved.values()) + chunk_dev
        loss.backward()
        times.append(time.perf_counter() - start)
        for t in [p["embed"], p["head"]] + [t for lp in p["layers"] for t in lp.values()]:
            t.grad = None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {
        "device_mib": device / 2**20,
        "host_mib": host / 2**20,
        "rss_growth_mib": peak - rss_before,
        "step_s": statistics.median(times),
    }


def _fit(lengths: list[int], mib: list[float]) -> tuple[float, float]:
    n = len(lengths)
    mx, my = sum(lengths) / n, sum(mib) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(lengths, mib, strict=True)) / sum((x - mx) ** 2 for x in lengths)
    return slope, my - slope * mx


def _run(mode: str, seq: int, chunk: int, steps: int) -> dict[str, float]:
    ranks = run_ranks(2, _measure, mode, seq, chunk, steps, timeout_s=1800)
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="1024,2048,4096", help="measured lengths (multiples of --chunk)")
    parser.add_argument("--chunk", type=int, default=512, help="FPDT's global chunk (tokens)")
    parser.add_argument("--steps", type=int, default=1)
    _report.add_json_argument(parser)
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    if any(n % args.chunk for n in lengths) or args.chunk % 2:
        parser.error("--lengths must be multiples of --chunk, and --chunk even (2 sequence ranks)")
    res = {m: {n: _run(m, n, args.chunk, args.steps) for n in lengths} for m in ("ulysses", "fpdt")}
    budget = res["ulysses"][lengths[-1]]["device_mib"]
    longest = {}
    for m in res:
        slope, icpt = _fit(lengths, [res[m][n]["device_mib"] for n in lengths])
        longest[m] = (budget - icpt) / slope
    check_len = int(longest["fpdt"] // args.chunk) * args.chunk
    res["fpdt"][check_len] = check = _run("fpdt", check_len, args.chunk, 1)
    print(
        f"GPT {LAYERS} layers, hidden {HIDDEN}, {HEADS} heads, FFN {INNER}, vocab {VOCAB}, fp32, batch 1, SP=2 "
        f"(gloo, CPU); FPDT chunk {args.chunk} tokens; memory per rank after forward (worst rank)"
    )
    print(f"{'tokens':>7} {'mode':<8}{'device MiB':>11}{'host MiB':>10}{'RSS growth':>11}{'step s':>9}")
    for m in res:
        for n in sorted(res[m]):
            r = res[m][n]
            print(
                f"{n:>7} {m:<8}{r['device_mib']:>11.1f}{r['host_mib']:>10.1f}{r['rss_growth_mib']:>11.0f}"
                f"{r['step_s']:>9.2f}"
            )
    ratio = longest["fpdt"] / longest["ulysses"]
    print(
        f"budget {budget:.1f} MiB (ulysses' device memory at {lengths[-1]} tokens): ulysses fits "
        f"{longest['ulysses']:.0f} tokens, fpdt {longest['fpdt']:.0f} ({ratio:.2f}x); "
        f"fpdt measured at {check_len} tokens: "
        f"{check['device_mib']:.1f} MiB ({'fits' if check['device_mib'] <= budget else 'OVER'})"
    )
    n = lengths[-1]
    rows = [
        _report.Row(
            "fpdt",
            f"longest sequence within {budget:.0f} MiB of device memory per rank, fpdt / ulysses (SP=2, linear fit)",
            ratio,
            target=">= 4",
        ),
        _report.Row(
            "fpdt",
            f"device memory per rank at {check_len} tokens, fpdt (measured) vs the budget",
            check["device_mib"],
            "MiB",
            f"ulysses at {n}",
            budget,
            target="<= 1",
        ),
        _report.Row(
            "fpdt",
            f"device memory per rank, fpdt vs ulysses, {n} tokens",
            res["fpdt"][n]["device_mib"],
            "MiB",
            "ulysses",
            res["ulysses"][n]["device_mib"],
        ),
        _report.Row(
            "fpdt",
            f"peak RSS growth per rank (everything, one RAM), fpdt vs ulysses, {n} tokens",
            res["fpdt"][n]["rss_growth_mib"],
            "MiB",
            "ulysses",
            res["ulysses"][n]["rss_growth_mib"],
        ),
        _report.Row(
            "fpdt",
            f"step time (worst rank), fpdt vs ulysses, {n} tokens",
            res["fpdt"][n]["step_s"],
            "s",
            "ulysses",
            res["ulysses"][n]["step_s"],
        ),
    ]
    _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
