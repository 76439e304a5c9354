"""SuperOffload: ZeRO-3 + CPU optimizer offload with and without `super_offload`, step time on gloo ranks.

Run: python benchmarks/superoffload.py [--steps 10] [--batch 4] [--seq 64] [--threads 1] [--clip 0] [--bf16]
     [--ranks 2]
Ranks: 2 by default; with `--ranks 1` (and one thread) the rank leaves the host's second core to SuperOffload's
worker, as a GPU rank leaves its host's cores to the CPU optimizer.
Model: benchmarks/zero.py's GPT (~21M parameters, tied embeddings), fp32, DeepSpeedCPUAdam through
`ds_engine.initialize` (ZeRO-3, `offload_optimizer.device: "cpu"`, `sub_group_size` a rank's shard of one
block, so the CPU step has about a dozen sub-groups to start during the backward). Both configs live in
the same pair of rank processes and run one step each in rotation (machine noise hits both alike); the
figure is the median of the per-round ratios (with / without), for the slower rank, beside each config's
median step time.
`--threads` is torch's intra-op threads per rank; SuperOffload's worker uses `cpuadam_cores_perc` (0.5
here) of the cores the rank may run on, beside them. `--clip` sets `gradient_clipping` (0: off): a clipped
step undoes the speculative updates and redoes them, and the next step does not speculate.
fp32 under ZeRO checks for inf/nan, so each in-backward update first copies what it overwrites (to undo a
skipped step); `--bf16` (without `check_grad_overflow`) makes no such copy.
Target: with / without <= 1.0 (the CPU step overlaps the backward; nothing is computed twice unclipped).
"""

from __future__ import annotations

import argparse
import statistics
import time

import _report
import torch
import torch.nn.functional as F
from zero import GPT

import ds_comm
import ds_engine
from ds_comm.testing import run_ranks

MODES = ("offload", "superoffload")


def _config(super_offload: bool, block: int, clip: float, bf16: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "bf16": {"enabled": bf16, "check_grad_overflow": False},
        "gradient_clipping": clip,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "reduce_bucket_size": block,
            "sub_group_size": block // 2,  # a rank's shard of one block
            "stage3_prefetch_bucket_size": block,
            "stage3_param_persistence_threshold": 100_000,
            "offload_optimizer": {"device": "cpu", "super_offload": super_offload}
            | ({"cpuadam_cores_perc": 0.5} if super_offload else {}),
        },
    }


def _build(mode: str, batch: int, seq: int, rank: int, steps: int, clip: float, bf16: bool):  # noqa: ANN202
    torch.manual_seed(0)
    model = GPT()
    block = sum(p.numel() for p in model.blocks[0].parameters())
    engine, *_ = ds_engine.initialize(model=model, config=_config(mode == "superoffload", block, clip, bf16))
    gen = torch.Generator().manual_seed(rank)
    data = [torch.randint(0, 8192, (batch, seq + 1), generator=gen) for _ in range(steps)]

    def one(i: int) -> tuple[float, float]:
        """One step; returns (loss, seconds spent in engine.step())."""
        idx = data[i % len(data)]
        logits = engine(idx[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))
        engine.backward(loss)
        start = time.perf_counter()
        engine.step()
        return loss.item(), time.perf_counter() - start

    return one, engine


def _time(rank: int, world: int, steps: int, batch: int, seq: int, threads: int, clip: float, bf16: bool) -> dict:
    torch.set_num_threads(threads)
    runners = {m: _build(m, batch, seq, rank, steps, clip, bf16) for m in MODES}
    walls: dict[str, list[float]] = {m: [] for m in MODES}
    step_walls: dict[str, list[float]] = {m: [] for m in MODES}
    losses: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(steps + 2):
        for mode in MODES:
            ds_comm.barrier()
            start = time.perf_counter()
            loss, step_wall = runners[mode][0](i)
            ds_comm.barrier()
            if i >= 2:  # warm-up: optimizer state, buffers, the gather trace
                walls[mode].append(time.perf_counter() - start)
                step_walls[mode].append(step_wall)
            losses[mode].append(loss)
    sup = runners["superoffload"][1].optimizer._super
    return {
        "walls": walls,
        "step_walls": {m: statistics.median(v) for m, v in step_walls.items()},
        "same_losses": losses["offload"] == losses["superoffload"],
        "speculative": sup.num_speculative,
        "undone": sup.num_undone,
        "copies": sup.num_undo_copies,
        "worker_threads": sup.num_threads,
        "tiles": len(sup.tiles),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clip", type=float, default=0.0)
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=2, help="rank processes")
    parser.add_argument(
        "--bf16", action="store_true", help="bf16 without check_grad_overflow: no step can be undone, no undo copies"
    )
    _report.add_json_argument(parser)
    args = parser.parse_args()
    ranks = run_ranks(
        args.ranks,
        _time,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        threads=args.threads,
        clip=args.clip,
        bf16=args.bf16,
        num_threads=args.threads,
        timeout_s=3600,
    )
    # per round, the slower rank's time; then medians and the median of the per-round ratios
    rounds = {m: [max(r["walls"][m][i] for r in ranks) for i in range(args.steps)] for m in MODES}
    median = {m: statistics.median(rounds[m]) for m in MODES}
    paired = statistics.median(s / o for s, o in zip(rounds["superoffload"], rounds["offload"], strict=True))
    info = ranks[0]
    print(
        f"GPT ~21M params, {'bf16' if args.bf16 else 'fp32'}, ZeRO-3 + CPU offload (DeepSpeedCPUAdam), "
        f"{args.ranks} gloo rank(s) x {args.threads} thread(s), batch {args.batch}x{args.seq} tokens/rank, "
        f"gradient_clipping {args.clip:g}; {info['tiles']} CPU sub-groups per rank, SuperOffload worker "
        f"{info['worker_threads']} thread(s); median of {args.steps} steps, configs "
        "interleaved step by step (slower rank)"
    )
    print(f"{'config':<16}{'wall s/step':>12}{'of it in step()':>17}")
    for mode in MODES:
        in_step = max(r["step_walls"][mode] for r in ranks)
        print(f"{mode:<16}{median[mode]:>12.3f}{in_step:>17.3f}")
    print(
        f"superoffload / offload (median of per-step ratios): {paired:.3f}; sub-group updates made during backward "
        f"{info['speculative']} ({info['copies']} with an undo copy), undone {info['undone']}; "
        f"same losses: {all(r['same_losses'] for r in ranks)}"
    )
    figure = f"ZeRO-3 + CPU offload step wall time with super_offload, paired median of {args.steps}"
    if args.clip:
        figure += f", gradient_clipping {args.clip:g}"
    if args.bf16:
        figure += ", bf16 (no undo copies)"
    if args.ranks == 1:
        figure += ", 1 rank (the worker on the core it leaves idle)"
    _report.write_rows(
        args.json,
        [
            _report.Row(
                # results.py's name for each run
                ("superoffload_bf16" if args.bf16 else "superoffload") + ("_1rank" if args.ranks == 1 else ""),
                figure,
                median["superoffload"],
                "s",
                "the same without super_offload",
                median["offload"],
                ratio=paired,
                target="<= 1.0" if not args.clip else "",
            )
        ],
    )


if __name__ == "__main__":
    main()
