"""One training measurement of benchmarks/gpu.py, run in its own process: build, warm up, time, report.

    python benchmarks/_gpu_modes.py MODE --layers N --dim D --heads H --vocab V --seq T --batch B
        --warmup W --steps S [--nvme DIR] [--cpu]

Modes (all bf16 compute, AdamW lr 1e-4, the same GPT from examples/gpt.py and the same random tokens):
  torch          plain PyTorch: fp32 parameters, `torch.autocast(bfloat16)`, `torch.optim.AdamW(fused=True)`
  zero0          ds-engine, bf16 section, ZeRO stage 0 (bf16 parameters, fp32 masters, torch's fused AdamW)
  offload        ds-engine, bf16, ZeRO-Offload: stage 2 with the optimizer on pinned host memory (ds-ops CPU Adam)
  fsdp2_offload  torch FSDP2: `fully_shard` per block and at the root, bf16 `MixedPrecisionPolicy`,
                 `CPUOffloadPolicy(pin_memory=True)`, torch AdamW stepping on the host (world of one)
  infinity       ds-engine, bf16, ZeRO-Infinity: stage 3, parameters and optimizer state swapped to NVMe
                 (`--nvme`) through pinned aio buffers, the model built under `zero.Init`

The last stdout line is `RESULT <json>`: median step seconds, tokens/s, peak device memory (allocated
and reserved, GiB), peak host RSS (GiB), the loss of each step, and parameter count. A CUDA
out-of-memory error is reported as `{"oom": true}` (exit 0): for the size search it is an answer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402 - examples/ is not a package

MODES = ("torch", "zero0", "offload", "fsdp2_offload", "infinity")
LR = 1e-4


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(mode: str, args: argparse.Namespace, cfg: GPTConfig) -> dict[str, Any]:
    """The ds_config of a ds-engine mode (bf16, AdamW, no clipping, one micro batch per step)."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.batch,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
    }
    if mode == "zero0":
        config["zero_optimization"] = {"stage": 0}
    elif mode == "offload":
        config["zero_optimization"] = {
            "stage": 2,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "reduce_bucket_size": 200_000_000,
            "contiguous_gradients": True,
        }
    elif mode == "infinity":
        # The swap buffers must hold any one parameter, and all persistent (small) ones at once.
        persistent = (cfg.num_layers * 13 + 4) * cfg.dim
        largest = max(cfg.vocab_size * cfg.dim, 4 * cfg.dim * cfg.dim, 2 * persistent)
        nvme = str(args.nvme)
        config["zero_optimization"] = {
            "stage": 3,
            "stage3_param_persistence_threshold": 10 * cfg.dim,
            "stage3_prefetch_bucket_size": 2 * 12 * cfg.dim * cfg.dim,
            "stage3_max_live_parameters": largest * 2,
            "sub_group_size": 200_000_000,
            "offload_param": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": True,
                "buffer_count": 6,
                "buffer_size": largest,
                "max_in_cpu": 0,
            },
            "offload_optimizer": {"device": "nvme", "nvme_path": nvme, "pin_memory": True, "buffer_count": 4},
        }
        config["aio"] = {
            "block_size": 1 << 20,
            "queue_depth": 32,
            "intra_op_parallelism": 8,
            "single_submit": False,
            "overlap_events": True,
        }
    return config


def _build_engine(mode: str, args: argparse.Namespace, cfg: GPTConfig, device: torch.device) -> tuple[Any, Any]:
    import ds_engine

    config = ds_config(mode, args, cfg)
    if mode == "infinity":
        Path(args.nvme).mkdir(parents=True, exist_ok=True)
        with ds_engine.zero.Init(config_dict_or_path=config):
            model = GPT(cfg)
    else:
        with torch.device(device):
            model = GPT(cfg)
    engine, *_ = ds_engine.initialize(model=model, config=config, dist_init_required=False)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = engine(idx, targets)
        engine.backward(loss)
        engine.step()
        return loss

    return model, step


def _build_torch(cfg: GPTConfig, device: torch.device) -> tuple[Any, Any]:
    with torch.device(device):
        model = GPT(cfg)
    try:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0, fused=True)
    except RuntimeError:  # a CPU smoke run on a torch without the fused CPU kernel
        opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def _build_fsdp2(cfg: GPTConfig, device: torch.device) -> tuple[Any, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1)
    mesh = init_device_mesh(device.type, (1,))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    policy = {
        "mesh": mesh,
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda"),
    }
    model = GPT(cfg)  # on the host: with CPU offload the sharded parameters live there
    for block in model.blocks:
        fully_shard(block, **policy)
    fully_shard(model, **policy)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.0)

    def step(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return model, step


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device("cpu") if args.cpu else torch.device("cuda", 0)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    cfg = GPTConfig(
        vocab_size=args.vocab,
        block_size=args.seq,
        num_layers=args.layers,
        num_heads=args.heads,
        dim=args.dim,
        tie_embeddings=True,
    )
    torch.manual_seed(0)
    started = time.perf_counter()
    if args.mode == "torch":
        model, step = _build_torch(cfg, device)
    elif args.mode == "fsdp2_offload":
        model, step = _build_fsdp2(cfg, device)
    else:
        model, step = _build_engine(args.mode, args, cfg, device)
    build_s = time.perf_counter() - started
    params = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # ZeRO-3 keeps only a shard
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.warmup + args.steps, args.batch, args.seq + 1), generator=g)
    times, losses = [], []
    for i in range(args.warmup + args.steps):
        idx = tokens[i, :, :-1].to(device, non_blocking=True)
        targets = tokens[i, :, 1:].to(device, non_blocking=True)
        _sync(device)
        t0 = time.perf_counter()
        loss = step(idx, targets)
        _sync(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach().float()))
        print(f"step {i}: loss {losses[-1]:.4f} {time.perf_counter() - t0:.3f} s", flush=True)
    median = statistics.median(times)
    result = {
        "mode": args.mode,
        "params": params,
        "layers": args.layers,
        "dim": args.dim,
        "batch": args.batch,
        "seq": args.seq,
        "build_s": round(build_s, 2),
        "step_s": median,
        "step_s_all": times,
        "tokens_per_s": args.batch * args.seq / median,
        "losses": losses,
        "host_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    if device.type == "cuda":
        result["gpu_peak_allocated_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        result["gpu_peak_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=MODES)
    for name, default in (
        ("layers", 24),
        ("dim", 2048),
        ("heads", 16),
        ("vocab", 50304),
        ("seq", 1024),
        ("batch", 8),
        ("warmup", 2),
        ("steps", 4),
    ):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--nvme", type=Path, default=None, help="swap folder of the infinity mode")
    parser.add_argument("--cpu", action="store_true", help="run on the CPU (a smoke run of the code, not a figure)")
    args = parser.parse_args()
    if args.mode == "infinity" and args.nvme is None:
        parser.error("the infinity mode needs --nvme DIR (a folder on a local disk for the swap files)")
    try:
        result = measure(args)
    except (torch.OutOfMemoryError, RuntimeError) as err:  # pinned host memory fails as a RuntimeError
        if not isinstance(err, torch.OutOfMemoryError) and "out of memory" not in str(err).lower():
            raise
        result = {"mode": args.mode, "layers": args.layers, "oom": True, "error": str(err).splitlines()[0][:300]}
    finally:
        with contextlib.suppress(Exception):
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
