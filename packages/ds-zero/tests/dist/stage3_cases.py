"""Models and rank functions shared by the stage-3 distributed tests (module level, so ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ds_comm
import ds_zero

VOCAB, DIM, SEQ = 64, 32, 8


class Block(nn.Module):
    """Pre-LN MLP block: LayerNorm (small: persistent), two Linears (partitioned), a constant buffer."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x)))) * self.scale


class NestedOut(nn.Module):
    """A block whose output is nested and holds non-tensors: (tensor, {"aux": tensor, "tag": str})."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.inner = Block(dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, *, gate: float = 1.0) -> tuple[torch.Tensor, dict[str, Any]]:
        h = self.inner(x)
        return h + gate * self.proj(h), {"aux": h.pow(2).mean(dim=-1, keepdim=True), "tag": "nested"}


class TinyGPT(nn.Module):
    """Exercises stage 3: nested modules, a module called twice, tied embedding/lm-head, a frozen layer,
    buffers, a parameter on the root, nested/non-tensor outputs and a parameter read by a non-owner."""

    def __init__(self, vocab: int = VOCAB, dim: int = DIM, num_layers: int = 2) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Parameter(torch.randn(SEQ, dim) * 0.02)
        self.blocks = nn.ModuleList([Block(dim) for _ in range(num_layers)])
        self.shared = NestedOut(dim)
        self.frozen = nn.Linear(dim, dim)
        self.frozen.requires_grad_(False)
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.register_buffer("pos", torch.arange(SEQ))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe[self.pos[: idx.shape[1]]]
        for block in self.blocks:
            x = block(x)
        x, extra = self.shared(x, gate=0.5)
        x = self.frozen(x) + extra["aux"]
        x, _ = self.shared(x)
        # a parameter read by a module that does not own it (the root reads a block's weight)
        x = x + 0.1 * (x @ self.blocks[0].fc2.weight)[..., : x.shape[-1]]
        return self.lm_head(self.ln_f(x))


def make_model(seed: int = 0, **kwargs: Any) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def batch(rank: int, step: int, micro: int, batch_size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    idx = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    tgt = torch.randint(0, VOCAB, (batch_size, SEQ), generator=g)
    return idx, tgt


def loss_fn(logits: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tgt.reshape(-1))


def gathered_state(model: nn.Module) -> dict[str, torch.Tensor]:
    sd = ds_zero.consolidated_16bit_state_dict(model, rank0_only=False)
    return {k: v.float() for k, v in sd.items()}


STAGE3_CFG = {
    "stage": 3,
    "stage3_param_persistence_threshold": 40,  # LayerNorms, biases of width 32 stay whole
    "stage3_prefetch_bucket_size": 5000,
    "stage3_max_live_parameters": 12000,
    "stage3_max_reuse_distance": 3000,
    "reduce_bucket_size": 4000,
}


def train_steps(model: nn.Module, opt: Any, rank: int, steps: range, gas: int, hint: str | None = None) -> list[float]:
    """The stage-3 training loop: `gas` micro-batches through `opt.backward`, then one step; loss per step.

    `hint`: None, no `set_step_boundary` calls; "window", the engine's (True before the last micro-batch's
    backward); "never", always False (a caller that steps anyway: what it carried must not go stale)."""
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(gas):
            idx, tgt = batch(rank, step, micro)
            loss = loss_fn(model(idx), tgt) / gas
            if hint is not None:
                opt.set_step_boundary(hint == "window" and micro == gas - 1)
            opt.backward(loss)
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def train_stage3(
    rank: int,
    world: int,
    *,
    steps: int = 20,
    gas: int = 4,
    clip: float = 0.5,
    dtype: torch.dtype = torch.float32,
    config: dict[str, Any] | None = None,
    lr: float = 1e-2,
    use_init: bool = False,
    hint: str | None = None,
) -> dict[str, Any]:
    cfg = dict(STAGE3_CFG, **(config or {}))
    if use_init:
        with ds_zero.Init(config_dict_or_path={"zero_optimization": cfg}, dtype=dtype):
            model = make_model()
    else:
        model = make_model().to(dtype)
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    opt = ds_zero.DeepSpeedZeroOptimizer_Stage3(model, base, config=cfg, clip_grad=clip)
    losses = train_steps(model, opt, rank, range(steps), gas=gas, hint=hint)
    with torch.no_grad():
        eval_logits = model(batch(rank, 999, 0)[0]).float()
    return {
        "losses": losses,
        "state": gathered_state(model),
        "eval": eval_logits,
        "norm": opt.global_grad_norm,
        "peak": opt.parameter_offload.peak_live_numel,
        "gathers": opt.parameter_offload.num_param_gathers,
        "block_gathers": opt.parameter_offload.num_block_param_gathers,
    }


def train_ddp(
    rank: int, world: int, *, steps: int = 20, gas: int = 4, clip: float = 0.5, lr: float = 1e-2
) -> dict[str, Any]:
    model = make_model()
    ddp = nn.parallel.DistributedDataParallel(model)
    base = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    losses = []
    for step in range(steps):
        total = 0.0
        for micro in range(gas):
            idx, tgt = batch(rank, step, micro)
            loss = loss_fn(ddp(idx), tgt) / gas
            loss.backward()
            total += loss.item()
        if clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        base.step()
        base.zero_grad()
        losses.append(total)
    with torch.no_grad():
        eval_logits = model(batch(rank, 999, 0)[0])
    state = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "state": state, "eval": eval_logits}


def compare_with_ddp(
    rank: int, world: int, *, variants: dict[str, dict[str, Any]], steps: int = 20, gas: int = 4
) -> dict[str, Any]:
    """DDP once, then each stage-3 variant (keyword arguments of `train_stage3`), in the same processes."""
    out = {"ddp": train_ddp(rank, world, steps=steps, gas=gas)}
    for name, kwargs in variants.items():
        out[name] = train_stage3(rank, world, steps=steps, gas=gas, **kwargs)
    return out


class _RecordedWork:
    """A collective's handle that notes when it is waited for."""

    def __init__(self, work: Any, events: list[tuple[str, int]], index: int) -> None:
        self._work, self._events, self._index = work, events, index

    def wait(self) -> Any:
        self._events.append(("wait", self._index))
        return self._work.wait()


def reduce_scatter_order(rank: int, world: int, *, overlap_comm: bool, steps: int = 3) -> dict[str, Any]:
    """Train stage 3 with `overlap_comm` as given, recording when each gradient reduce-scatter is issued and waited."""
    events: list[tuple[str, int]] = []
    original = ds_comm.reduce_scatter_tensor

    def recording(*args: Any, **kwargs: Any) -> Any:
        work = original(*args, **kwargs)
        index = sum(1 for kind, _ in events if kind == "issue")
        events.append(("issue", index))
        return _RecordedWork(work, events, index) if work is not None else work

    # on two gloo ranks a bucket's reduce-scatter is a pair exchange (ds_comm.pair_exchange): recorded alike
    original_pair = ds_comm.pair_exchange

    def recording_pair(*args: Any, **kwargs: Any) -> Any:
        work = original_pair(*args, **kwargs)
        if work is None or kwargs.get("op") != "reduce_scatter_tensor":
            return work
        index = sum(1 for kind, _ in events if kind == "issue")
        events.append(("issue", index))
        return _RecordedWork(work, events, index)

    ds_comm.reduce_scatter_tensor = recording
    ds_comm.pair_exchange = recording_pair
    try:
        out = train_stage3(rank, world, steps=steps, gas=2, config={"overlap_comm": overlap_comm})
    finally:
        ds_comm.reduce_scatter_tensor = original
        ds_comm.pair_exchange = original_pair
    out["events"] = events
    return out


def partition_tensors(opt: Any, stage: int) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """This rank's masters, gradient partitions and partition-shaped optimizer moments."""
    if stage == 3:
        masters = [part.master for part in opt.partitions]
        grads = [part.master.grad for part in opt.partitions if part.master.grad is not None]
        keys = [tile.master for tile in opt.tiles]
    else:
        masters, grads, keys = list(opt.masters), list(opt.grad_partitions), list(opt.masters)
    states = [
        t for key in keys for name, t in opt.optimizer.state[key].items() if name != "step" and t.numel() == key.numel()
    ]
    return masters, grads, states


def state_bytes_per_element(opt: Any, model: torch.nn.Module, rank: int, stage: int) -> float:
    """Model-state bytes per trained element of this rank's partition, measured mid-step (gradients held)."""
    idx, tgt = batch(rank, 100, 0)
    opt.backward(loss_fn(model(idx), tgt))
    masters, grads, states = partition_tensors(opt, stage)
    numel = sum(m.numel() for m in masters)
    total = sum(t.numel() * t.element_size() for t in [*masters, *grads, *states])
    opt.zero_grad()
    return total / numel
