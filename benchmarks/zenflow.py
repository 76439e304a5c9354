"""ZenFlow on gloo ranks: ZeRO-2 + CPU optimizer offload, ZenFlow, ZenFlow with overlap_step; ds and DeepSpeed.

Run: python benchmarks/zenflow.py [--steps 24] [--stage 2|3] [--ranks 1|2]
     [--deepspeed-python /work/dsref/bin/python] [--json PATH]
Ranks: 2 by default. With --ranks 1 the rank leaves the host's second core to the ZenFlow worker, as a GPU
rank leaves its host's cores to it (on this 2-core host, 2 ranks leave no core idle).
Model: the GPT-style decoder of benchmarks/zero.py, smaller (vocab 4096, 4 layers of width 256, ~4.5M
parameters), AdamW lr 1e-3, fp32, batch 4 x 64 tokens per rank, the same seeded data on both sides.
ZenFlow: topk_ratio 0.1, select_strategy step, select_interval 8, update_interval 4.

Per mode, each side runs its own pair of rank processes; reported: the median step time (forward,
backward, step) of the slower rank, the mean loss of the last quarter of the steps, and for ds the CPU
optimizer time the training process still waits for: with overlap_step, the time spent in the ZenFlow
update call per window (waiting for the worker, copying its result, handing over the next window) as a
share of the same call's time without overlap (the whole CPU Adam step); the all-gather of the updated
partitions that ends every ZeRO-1/2 step is not counted on either side. Goal: <= 10%.
DeepSpeed 0.19.8 runs with `DS_ACCELERATOR=cpu`; its ZenFlow starts from reshuffled weights (its
transposed-view bug, see packages/ds-engine/tests/data/record_zenflow_deepspeed.py), so its losses are
shown, not compared. With `--stage 3` every mode runs at ZeRO-3 (ds's `ZenFlowZeroOptimizer_Stage3`); DeepSpeed
is not run then, as its ZeRO-3 ZenFlow needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
MODES = ("offload", "zenflow", "zenflow+overlap")
ZENFLOW = {"topk_ratio": 0.1, "select_strategy": "step", "select_interval": 8, "update_interval": 4}
BATCH, SEQ, VOCAB = 4, 64, 4096


def _config(mode: str, stage: int = 2) -> dict:
    zero: dict = {"stage": stage, "offload_optimizer": {"device": "cpu"}}
    if mode != "offload":
        zero["zenflow"] = dict(ZENFLOW, overlap_step=mode.endswith("overlap"))
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
        "zero_optimization": zero,
        "gradient_clipping": 1.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**6,
    }


def _rank(rank: int, world: int, port: int, side: str, mode: str, steps: int, out: str, stage: int) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world)})
    os.environ.update({"LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from _gpt import GPT  # benchmarks/zero.py's decoder, importable without ds (DeepSpeed's venv runs it too)

    ds = __import__("deepspeed" if side == "deepspeed" else "ds_engine")
    ds.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, width=256, layers=4, heads=4, block=SEQ)
    for module in model.modules():  # GPT-2's init scale (the tied N(0, 1) embedding gives logits in the hundreds)
        if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
            torch.nn.init.normal_(module.weight, std=0.02)
    engine, *_ = ds.initialize(model=model, model_parameters=model.parameters(), config=_config(mode, stage))
    g = torch.Generator().manual_seed(100 + rank)
    times, losses = [], []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        start = time.perf_counter()
        logits = engine(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        engine.backward(loss)
        engine.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    opt = engine.optimizer
    result = {
        "times": times,
        "losses": losses,
        "update_times": getattr(opt, "cpu_update_times", None),
    }
    if side == "ds":
        engine.destroy()
    torch.save(result, f"{out}.{rank}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_side(side: str, steps: int, modes: list[str], stage: int = 2, world: int = 2) -> dict:
    out = Path(tempfile.mkdtemp()) / "rank"
    results = {}
    for mode in modes:
        mp.spawn(_rank, args=(world, _free_port(), side, mode, steps, str(out), stage), nprocs=world, join=True)
        ranks = [torch.load(f"{out}.{r}") for r in range(world)]
        warm = max(2, steps // 4)
        step = max(statistics.median(r["times"][warm:]) for r in ranks)
        tail = ranks[0]["losses"][-max(1, steps // 4) :]
        updates = ranks[0]["update_times"]
        results[mode] = {
            "step_ms": 1e3 * step,
            "tail_loss": sum(tail) / len(tail),
            "losses": ranks[0]["losses"],
            # the median update (the first ones start the worker and warm up)
            "update_ms": 1e3 * statistics.median(updates[2:] or updates) if updates else None,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--stage", type=int, choices=(2, 3), default=2)
    parser.add_argument("--ranks", type=int, choices=(1, 2), default=2, help="rank processes per side")
    parser.add_argument("--deepspeed-python", default="/work/dsref/bin/python")
    parser.add_argument("--side", choices=("ds", "deepspeed"), default="ds", help=argparse.SUPPRESS)
    sys.path.insert(0, str(HERE))
    import _report

    _report.add_json_argument(parser)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if args.side == "deepspeed":  # the child run under DeepSpeed's venv
        print(json.dumps(run_side("deepspeed", args.steps, modes, world=args.ranks)))
        return
    ours = run_side("ds", args.steps, modes, args.stage, args.ranks)
    theirs: dict = {}
    if args.stage == 3:
        print("DeepSpeed not run: its ZeRO-3 ZenFlow needs CUDA")
    elif args.deepspeed_python and Path(args.deepspeed_python).exists():
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env["DS_ACCELERATOR"] = "cpu"
        cmd = [
            args.deepspeed_python,
            __file__,
            "--side",
            "deepspeed",
            "--steps",
            str(args.steps),
            "--ranks",
            str(args.ranks),
        ]
        proc = subprocess.run([*cmd, "--modes", args.modes], env=env, capture_output=True, text=True, check=False)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        theirs = json.loads(lines[-1]) if lines else {}
        if not theirs:
            print("DeepSpeed side failed:", proc.stderr[-2000:])
    print(f"{'mode':<18}{'ds step ms':>12}{'DeepSpeed ms':>14}{'ds/DS':>8}{'ds tail loss':>14}{'DS tail loss':>14}")
    for mode in modes:
        o, t = ours[mode], theirs.get(mode)
        ratio = o["step_ms"] / t["step_ms"] if t else float("nan")
        print(
            f"{mode:<18}{o['step_ms']:>12.1f}{(t['step_ms'] if t else float('nan')):>14.1f}{ratio:>8.2f}"
            f"{o['tail_loss']:>14.4f}{(t['tail_loss'] if t else float('nan')):>14.4f}"
        )
    share = None
    if "zenflow" in ours and "zenflow+overlap" in ours:
        share = ours["zenflow+overlap"]["update_ms"] / ours["zenflow"]["update_ms"]
        print(
            f"CPU update time visible in the step: {ours['zenflow+overlap']['update_ms']:.1f} ms per window with "
            f"overlap_step vs {ours['zenflow']['update_ms']:.1f} ms without = {100 * share:.1f}% (goal <= 10%)"
        )
    print("loss curves (ds, rank 0):")
    for mode in modes:
        print(f"  {mode:<18}" + " ".join(f"{x:.3f}" for x in ours[mode]["losses"]))
    if args.json:
        name = "zenflow" if args.ranks == 2 else "zenflow_1rank"  # results.py's name for each run
        ranks = f"{args.ranks} rank" + ("s" if args.ranks > 1 else "")
        rows = [
            _report.Row(
                name,
                f"{mode} step time, {ranks}" + (", ZeRO-3" if args.stage == 3 else ""),
                ours[mode]["step_ms"],
                "ms",
                "DeepSpeed 0.19.8",
                theirs[mode]["step_ms"] if mode in theirs else None,
            )
            for mode in modes
        ]
        if share is not None:
            rows.append(
                _report.Row(
                    name,
                    f"overlap_step: CPU update time visible, {ranks}",
                    100 * share,
                    "%",
                    target="<= 10 %",
                )
            )
        _report.write_rows(args.json, rows)


if __name__ == "__main__":
    main()
