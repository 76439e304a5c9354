"""Kill a checkpoint save with SIGKILL at every file-system step and load what is left (run as a script).

`python checkpoint_kill_driver.py KIND WORKDIR` prints one JSON report. KIND is one of `KINDS`
(engine ZeRO-0 on 1 rank; ZeRO-2 (stage 1 writes the same files), ZeRO-3, a 2-stage pipeline, and
ZeRO-2 saving in DeepSpeed's layout on 2 gloo ranks).

For each kind:
1. A reference group trains a tiny model, saves checkpoint 1 (`global_step1`), trains a step,
   and saves checkpoint 2 (`global_step2`) while counting the file-system steps of that save on each
   rank (`ds_comm.testing.file_events`: open, write, fsync, replace, fsync_dir of every file).
2. Fresh groups load each reference checkpoint by tag and record a fingerprint of the state they
   got: counters, lr, the loss on a fixed batch, and the loss and loss after one more training
   step (so module weights, optimizer moments and the scheduler all enter it).
3. For every rank r and every step n of r's save that leaves its own state on disk
   (`_distinct_kill_points`): a fresh group with a copy of checkpoint 1 saves checkpoint 2 again
   and rank r SIGKILLs itself at its n-th step (the other ranks are SIGKILLed right after, as a
   launcher ends a job whose rank died). Then a fresh group loads `latest` and
   its fingerprint must equal checkpoint 1's, or checkpoint 2's when `latest` already names it.

[Note: speed] Every group is `os.fork()`ed from this process, which first builds one plain engine
(no process group, one thread) so that the imports an engine pulls in lazily (~2.5 s: the config
models, optimizers, sympy through torch) are done once; a rank then starts in milliseconds. With
one thread no OpenMP pool exists yet, so forking after those few ops is safe.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # ds_engine_testkit

import torch  # noqa: E402
from ds_engine_testkit import base_config, batches, loss_fn, make_engine, tiny_net  # noqa: E402
from torch import nn  # noqa: E402

import ds_comm  # noqa: E402
import ds_engine  # noqa: E402
from ds_comm.testing import file_events, free_port  # noqa: E402

#: kind -> (world size, ZeRO stage or "pipe")
KINDS: dict[str, tuple[int, int | str]] = {
    "zero0": (1, 0),
    "zero2": (2, 2),
    "zero3": (2, 3),
    "pipeline": (2, "pipe"),
    "zero2_deepspeed": (2, 2),
}
#: kinds saving with `checkpoint.layout: "deepspeed"` (staged ds save, DeepSpeed files, one rename, latest)
_DEEPSPEED_LAYOUT = {"zero2_deepspeed"}
_GROUP_TIMEOUT_S = 90.0
_SCHED = {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_max_lr": 1e-2}}
_D, _H, _OUT, _ROWS, _GAS = 8, 12, 4, 3, 2


# -- the model and loop of each kind ------------------------------------------------------------------
def _pipe_engine(seed: int) -> Any:
    from ds_pipe import LayerSpec, PipeDataParallelTopology, PipelineModule

    torch.manual_seed(seed)
    layers = [
        LayerSpec(nn.Linear, _D, _H),
        LayerSpec(nn.Tanh),
        LayerSpec(nn.Linear, _H, _D),
        LayerSpec(nn.Linear, _D, _OUT),
    ]
    module = PipelineModule(
        layers,
        topology=PipeDataParallelTopology(num_pp=2, num_dp=1),
        loss_fn=lambda out, y: nn.functional.mse_loss(out, y),
        partition_method=[0, 2, 4],
    )
    config = {
        "train_micro_batch_size_per_gpu": _ROWS,
        "gradient_accumulation_steps": _GAS,
        "gradient_clipping": 1.0,
        "scheduler": _SCHED,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
    }
    engine, *_ = ds_engine.initialize(model=module, config=config)
    return engine


def _engine(kind: str, seed: int) -> Any:
    stage = KINDS[kind][1]
    if stage == "pipe":
        return _pipe_engine(seed)
    config = base_config(scheduler=_SCHED, gradient_clipping=1.0)
    if stage:
        config["zero_optimization"] = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if kind in _DEEPSPEED_LAYOUT:
        config["checkpoint"] = {"layout": "deepspeed"}
    init = ds_engine.zero.Init() if stage == 3 else contextlib.nullcontext()
    with init:
        model = tiny_net(seed)
    return make_engine(model, config)


def _pipe_batches(step: int) -> Any:
    g = torch.Generator().manual_seed(1000 + step)
    return iter([(torch.randn(_ROWS, _D, generator=g), torch.randn(_ROWS, _OUT, generator=g)) for _ in range(_GAS)])


def _train_step(engine: Any, kind: str, step: int, rank: int) -> float:
    if KINDS[kind][1] == "pipe":
        return float(engine.train_batch(_pipe_batches(step)))
    x, y = batches(1, 4, seed=100 * step + rank)[0]
    loss = loss_fn(engine(x), y)
    engine.backward(loss)
    engine.step()
    return float(loss.detach())


def _eval_loss(engine: Any, kind: str, rank: int) -> float:
    if KINDS[kind][1] == "pipe":
        return float(engine.eval_batch(_pipe_batches(999)))
    x, y = batches(1, 4, seed=7777 + rank)[0]
    with torch.no_grad():
        return float(loss_fn(engine(x), y))


def _fingerprint(engine: Any, kind: str, rank: int) -> list[Any]:
    """What a loaded state determines: counters, lr, a loss; then one more step's loss and the loss after it."""
    head = [
        engine.global_steps,
        engine.global_samples,
        engine.micro_steps,
        engine.skipped_steps,
        engine.get_lr(),
        _eval_loss(engine, kind, rank),
    ]
    return [*head, _train_step(engine, kind, 50, rank), _eval_loss(engine, kind, rank)]


# -- roles, run in forked ranks -----------------------------------------------------------------------
def _save_role(
    rank: int, world: int, kind: str, save_dir: str, kill_rank: int, kill_at: int, marker: str, first_save: bool
) -> list[str]:
    """Train two steps and save after each; rank `kill_rank` dies at the `kill_at`-th file step of the second save.

    Returns the second save's file steps on this rank (`"<event> <dir>/<file>"`, in order).

    A killed run starts from a copy of the reference's checkpoint 1, so it skips saving it again
    (`first_save` false): saving changes no training state, and the reference's event counts, which
    the test compares against, show the second save's steps are the same either way.
    """
    engine = _engine(kind, seed=0)
    _train_step(engine, kind, 0, rank)
    if first_save:
        engine.save_checkpoint(save_dir)  # global_step1
    _train_step(engine, kind, 1, rank)
    seen: list[str] = []

    def hook(event: str, path: Path) -> None:
        where = "ckpt" if path.parent == Path(save_dir) else path.parent.name  # the reference saves into ref/
        seen.append(f"{event} {where}/{path.name}")
        if rank == kill_rank and len(seen) == kill_at:
            Path(marker).write_text(seen[-1])
            os.kill(os.getpid(), signal.SIGKILL)

    with file_events(hook):
        engine.save_checkpoint(save_dir)  # global_step2
    return seen


def _load_role(rank: int, world: int, kind: str, save_dir: str, tag: str | None) -> dict[str, Any]:
    engine = _engine(kind, seed=123)  # different initial weights: only the checkpoint can make them match
    path, _ = engine.load_checkpoint(save_dir, tag=tag)
    if path is None:
        return {"tag": None, "fingerprint": None}
    return {"tag": Path(path).parent.name, "fingerprint": _fingerprint(engine, kind, rank)}


# -- process groups forked from this driver -----------------------------------------------------------
def _rank_main(rank: int, world: int, port: int, out: Path, role: Callable[..., Any], kwargs: dict[str, Any]) -> None:
    code = 0
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
        )
        ds_comm.init_distributed(
            dist_backend="gloo",
            auto_mpi_discovery=False,
            verbose=False,
            timeout=timedelta(seconds=_GROUP_TIMEOUT_S / 3),
        )
        result = role(rank, world, **kwargs)
        (out / f"rank{rank}.json").write_text(json.dumps(result))
    except BaseException:  # noqa: BLE001 - reported through the exit code and stderr
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run_group(
    world: int, out: Path, role: Callable[..., Any], *, victim: int | None = None, **kwargs: Any
) -> tuple[list[int], list[Any]]:
    """Fork `world` ranks running `role`; returns (exit statuses, results). When `victim` dies, the rest are killed."""
    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    pids = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            _rank_main(rank, world, port, out, role, kwargs)
        pids.append(pid)
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + _GROUP_TIMEOUT_S
    while len(statuses) < world:
        for rank, pid in enumerate(pids):
            if rank in statuses:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                statuses[rank] = status
                if rank == victim:
                    for other, other_pid in enumerate(pids):
                        if other not in statuses:
                            os.kill(other_pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            for rank, pid in enumerate(pids):
                if rank not in statuses:
                    os.kill(pid, signal.SIGKILL)
                    statuses[rank] = os.waitpid(pid, 0)[1]
            raise TimeoutError(f"{role.__name__} group did not finish within {_GROUP_TIMEOUT_S}s ({kwargs})")
        time.sleep(0.01)
    results = []
    for rank in range(world):
        file = out / f"rank{rank}.json"
        results.append(json.loads(file.read_text()) if file.is_file() else None)
    return [statuses[r] for r in range(world)], results


def _checked(world: int, out: Path, role: Callable[..., Any], **kwargs: Any) -> list[Any]:
    statuses, results = _run_group(world, out, role, **kwargs)
    if any(statuses):
        raise RuntimeError(f"{role.__name__} failed with statuses {statuses} ({kwargs}); see stderr")
    return results


def _warm_up(kind: str) -> None:
    make_engine(tiny_net(0), base_config())
    if KINDS[kind][1] == "pipe":
        import ds_pipe  # noqa: F401
    elif KINDS[kind][1]:
        # ds_zero's names are lazy: import the optimizers themselves, or every forked rank imports them again.
        import ds_zero._construct  # noqa: F401
        import ds_zero._stage3.optimizer  # noqa: F401
        import ds_zero._stage12.optimizer  # noqa: F401


def _distinct_kill_points(events: list[str]) -> list[int]:
    """The steps (1-based) worth killing at: those whose kill leaves a state on disk no other kill leaves.

    A SIGKILL ends the process, not the machine: the page cache survives, so an fsync changes nothing a
    later reader sees. A kill before `fsync X` leaves what a kill before `replace X` leaves (X's temp
    file, written, not renamed), and a kill before `fsync_dir X` what a kill before the next file's
    `open` leaves (X renamed). Those are skipped, save the last step (the `latest` rename's fsync_dir,
    after which `latest` names the new checkpoint). The reference run still records, and the test checks,
    every step in order.
    """
    last = len(events)
    return [n for n, event in enumerate(events, start=1) if not event.startswith("fsync") or n == last]


def drive(kind: str, workdir: Path) -> dict[str, Any]:
    world = KINDS[kind][0]
    start = time.monotonic()
    _warm_up(kind)
    ref = workdir / "ref"
    steps = _checked(
        world,
        workdir / "out-ref",
        _save_role,
        kind=kind,
        save_dir=str(ref),
        kill_rank=-1,
        kill_at=0,
        marker="",
        first_save=True,
    )
    expected = {
        tag: _checked(world, workdir / f"out-{tag}", _load_role, kind=kind, save_dir=str(ref), tag=tag)
        for tag in ("global_step1", "global_step2")
    }
    base = workdir / "base"  # checkpoint 1 alone, as the killed saves start from it
    shutil.copytree(ref, base, ignore=shutil.ignore_patterns("global_step2"))
    (base / "latest").write_text("global_step1")
    points = []
    for victim in range(world):
        for n in _distinct_kill_points(steps[victim]):
            case = workdir / f"kill-r{victim}-{n}"
            save_dir = case / "ckpt"
            shutil.copytree(base, save_dir)
            marker = case / "killed-at"
            statuses, _ = _run_group(
                world,
                case / "out-save",
                _save_role,
                victim=victim,
                kind=kind,
                save_dir=str(save_dir),
                kill_rank=victim,
                kill_at=n,
                marker=str(marker),
                first_save=False,
            )
            loaded = _checked(world, case / "out-load", _load_role, kind=kind, save_dir=str(save_dir), tag=None)
            latest = (save_dir / "latest").read_text()
            points.append(
                {
                    "rank": victim,
                    "n": n,
                    "event": marker.read_text() if marker.is_file() else None,
                    "killed": os.WIFSIGNALED(statuses[victim]) and os.WTERMSIG(statuses[victim]) == signal.SIGKILL,
                    "latest": latest,
                    "loaded_tag": [r["tag"] for r in loaded],
                    "matches": all(
                        r["fingerprint"] == expected.get(latest, [None] * world)[i]["fingerprint"]
                        for i, r in enumerate(loaded)
                    )
                    if latest in expected
                    else False,
                }
            )
            shutil.rmtree(case)
    return {
        "kind": kind,
        "world": world,
        "events": steps,
        "distinct": expected["global_step1"] != expected["global_step2"],
        "points": points,
        "seconds": round(time.monotonic() - start, 1),
    }


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(drive(sys.argv[1], Path(sys.argv[2]))))
