"""Engine overhead: ds-engine (ZeRO stage 0) vs a hand-written torch DDP loop, 2 gloo ranks, ~20M-param GPT.

Measures, on each rank, the CPU time (process time: all threads, incl. gloo's) and wall time per
optimizer step, and the cost of setting up: `ds_engine.initialize(...)` against `DDP(model)` plus
the optimizer (the first call in the process separately from later ones: it carries one-time
costs). Both loops do the same work: forward, backward, all-reduce, clip to norm 1.0, torch AdamW
step. The two loops alternate step by step so drift on a shared machine hits both alike; the
median of the paired per-step ratios is printed beside the ratio of medians.

    python benchmarks/engine_overhead.py [--steps 6] [--rounds 3]

Targets: step CPU time <= 1.03x DDP; initialize() <= 1.5x DDP setup.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import _report
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ds_engine
from ds_comm.testing import run_ranks

VOCAB, SEQ, D_MODEL, LAYERS, HEADS, MICRO = 8192, 128, 384, 10, 6, 4


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D_MODEL), nn.LayerNorm(D_MODEL)
        self.qkv = nn.Linear(D_MODEL, 3 * D_MODEL)
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.fc, self.out = nn.Linear(D_MODEL, 4 * D_MODEL), nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D_MODEL // HEADS).permute(2, 0, 3, 1, 4)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, D_MODEL)
        x = x + self.proj(att)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, D_MODEL), nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D_MODEL)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln(x) @ self.tok.weight.t()  # tied head


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


CONFIG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "torch_adam": True}},
}


def _ddp_setup(model: nn.Module):
    wrapped = DDP(model)
    return wrapped, torch.optim.AdamW(wrapped.parameters(), lr=3e-4)


def _ddp_step(state, idx, targets) -> None:
    model, opt = state
    _loss(model(idx), targets).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)


def _engine_setup(model: nn.Module):
    engine, *_ = ds_engine.initialize(model=model, config=CONFIG)
    return engine


def _engine_step(engine, idx, targets) -> None:
    engine.backward(_loss(engine(idx), targets))
    engine.step()


def _timed(fn, *args) -> tuple[float, float]:
    torch.distributed.barrier()
    c, w = time.process_time(), time.perf_counter()
    fn(*args)
    return time.process_time() - c, time.perf_counter() - w


def _bench(rank: int, world: int, steps: int, rounds: int) -> dict[str, list[float]]:
    g = torch.Generator().manual_seed(rank)
    data = [
        (torch.randint(0, VOCAB, (MICRO, SEQ), generator=g), torch.randint(0, VOCAB, (MICRO, SEQ), generator=g))
        for _ in range(steps)
    ]
    out: dict[str, list[float]] = {
        f"{n}_{k}": []
        for n in ("ddp", "eng")
        for k in ("step_cpu", "step_wall", "first_setup_cpu", "first_setup_wall", "setup_cpu", "setup_wall")
    }
    torch.manual_seed(0)
    ddp_model, eng_model = GPT(), GPT()
    out["params"] = [sum(p.numel() for p in ddp_model.parameters())]
    for name, setup in (("ddp", _ddp_setup), ("eng", _engine_setup)):
        for call in range(3):  # fresh copies; the first call in the process is reported on its own row
            fresh = GPT()
            torch.distributed.barrier()
            c, w = time.process_time(), time.perf_counter()
            setup(fresh)
            key = f"{name}_first_setup" if call == 0 else f"{name}_setup"
            out[f"{key}_cpu"].append(time.process_time() - c)
            out[f"{key}_wall"].append(time.perf_counter() - w)
            del fresh
    ddp_state, engine = _ddp_setup(ddp_model), _engine_setup(eng_model)
    _ddp_step(ddp_state, *data[0])  # warm-up: allocation, first all-reduce
    _engine_step(engine, *data[0])
    order = (("ddp", _ddp_step, ddp_state), ("eng", _engine_step, engine))
    for i in range(rounds * steps):
        # Interleave step by step (alternating which goes first) so load drift hits both loops alike.
        idx, targets = data[i % steps]
        for name, step, state in order if i % 2 == 0 else order[::-1]:
            cpu, wall = _timed(step, state, idx, targets)
            out[f"{name}_step_cpu"].append(cpu)
            out[f"{name}_step_wall"].append(wall)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6, help="distinct batches per rank")
    parser.add_argument("--rounds", type=int, default=3, help="passes over the batches (steps x rounds timed steps)")
    _report.add_json_argument(parser)
    args = parser.parse_args()
    json_rows = []
    results = run_ranks(2, _bench, steps=args.steps, rounds=args.rounds, timeout_s=3600, num_threads=1)
    merged = {k: [v for r in results for v in r[k]] for k in results[0]}
    params = merged.pop("params")[0]
    print(
        f"GPT: {params / 1e6:.1f}M params, {LAYERS} layers, d_model {D_MODEL}, seq {SEQ}, micro batch {MICRO}, "
        f"2 gloo ranks x 1 thread; {args.rounds * args.steps} interleaved steps per loop (medians over both ranks)"
    )
    print(f"{'':<26}{'torch DDP':>12}{'ds-engine':>12}{'ratio':>8}  target")
    rows = (
        ("step CPU time (ms)", "step_cpu", "<= 1.03"),
        ("step wall time (ms)", "step_wall", ""),
        ("setup CPU time (ms)", "setup_cpu", "<= 1.5"),
        ("setup wall time (ms)", "setup_wall", ""),
        ("first setup CPU (ms)", "first_setup_cpu", ""),
        ("first setup wall (ms)", "first_setup_wall", ""),
    )
    for label, key, target in rows:
        ddp, eng = statistics.median(merged[f"ddp_{key}"]), statistics.median(merged[f"eng_{key}"])
        ratio = eng / ddp if ddp > 0 else math.nan
        print(f"{label:<26}{ddp * 1e3:>12.1f}{eng * 1e3:>12.1f}{ratio:>8.3f}  {target}")
        json_rows.append(
            _report.Row(
                "engine_overhead",
                f"{label.removesuffix(' (ms)')}, ds-engine stage 0",
                eng * 1e3,
                "ms",
                "torch DDP + AdamW",
                ddp * 1e3,
                target=target,
            )
        )
    for key in ("step_cpu", "step_wall"):
        paired = [e / d for e, d in zip(merged[f"eng_{key}"], merged[f"ddp_{key}"], strict=True) if d > 0]
        print(
            f"median of paired per-step ratios, {key.replace('_', ' ')}: {statistics.median(paired):.3f} "
            f"(n={len(paired)})"
        )
    _report.write_rows(args.json, json_rows)


if __name__ == "__main__":
    main()
