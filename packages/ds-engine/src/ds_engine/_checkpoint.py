"""save_checkpoint / load_checkpoint / save_16bit_model: DeepSpeed's layout, written atomically.

Layout of `save_dir` (see the package README):
    latest                                          the last complete tag (no trailing newline)
    <tag>/mp_rank_00_model_states.pt                rank 0: module, counters, lr scheduler, RNG of every
                                                    rank, stage-0 optimizer (incl. loss scaler, fp32 masters)
    <tag>/zero_pp_rank_<r>_mp_rank_00_optim_states.pt   ZeRO >= 1 only: rank r's ds-zero partition

[Note: crash safety] Every file goes to a hidden temporary name and is renamed when complete;
all ranks finish their files before rank 0 switches `latest`, so a save killed at any point leaves
`latest` naming the previous complete tag.
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import random
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import ds_comm
from ds_engine.__about__ import __version__
from ds_engine._atomic import atomic_save, atomic_write_text
from ds_engine._optional import require

if TYPE_CHECKING:
    from ds_engine._engine import DeepSpeedEngine

logger = logging.getLogger(__name__)

__all__ = ["load_checkpoint", "save_16bit_model", "save_checkpoint"]

#: Keys of the model-states file the engine restores itself; everything else is returned as client_state.
_ENGINE_KEYS = ("module", "optimizer", "lr_scheduler", "skipped_steps", "global_steps", "micro_steps",
                "rng_states", "data_sampler", "random_ltd")


def _model_file(ckpt_dir: Path, mp_rank: int) -> Path:
    return ckpt_dir / f"mp_rank_{mp_rank:02d}_model_states.pt"


def _zero_file(ckpt_dir: Path, dp_rank: int, mp_rank: int) -> Path:
    return ckpt_dir / f"zero_pp_rank_{dp_rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = sys.modules.get("numpy")
    if "numpy" in state and numpy is not None:
        numpy.random.set_state(state["numpy"])


def _check_tag(engine: DeepSpeedEngine, tag: str) -> None:
    mode = engine._ckpt_config.tag_validation
    if mode == "IGNORE" or engine.world_size == 1 or not ds_comm.is_initialized():
        return
    digest = int.from_bytes(hashlib.sha1(tag.encode()).digest()[:7], "big")
    lo = torch.tensor([digest], dtype=torch.int64, device=engine.device)
    hi = lo.clone()
    ds_comm.all_reduce(lo, op=ds_comm.ReduceOp.MIN)
    ds_comm.all_reduce(hi, op=ds_comm.ReduceOp.MAX)
    if lo.item() != hi.item():
        message = f"checkpoint tag {tag!r} differs across ranks (checkpoint.tag_validation={mode})"
        if mode == "FAIL":
            raise ValueError(message + "; pass the same tag on every rank")
        logger.warning(message)


def _all_gather_pickled(obj: Any, world_size: int, device: torch.device) -> list[Any]:
    """Every rank's `obj`, in rank order, through two tensor all-gathers.

    [Note: why not all_gather_object] torch's object collectives decode through numpy, which is
    not a torch dependency; this path needs only tensors (on `device`, so it works on nccl too).
    """
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
    size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros_like(size) for _ in range(world_size)]
    ds_comm.all_gather(sizes, size)
    longest = max(int(n) for n in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[:payload.numel()] = payload
    gathered = [torch.zeros_like(padded) for _ in range(world_size)]
    ds_comm.all_gather(gathered, padded)
    return [pickle.loads(bytes(g[:int(n)].cpu().tolist())) for g, n in zip(gathered, sizes, strict=True)]


def _gather_rng(engine: DeepSpeedEngine) -> list[dict[str, Any]]:
    state = _rng_state()
    if engine.world_size == 1 or not ds_comm.is_initialized():
        return [state]
    return _all_gather_pickled(state, engine.world_size, engine.device)


def _model_states(engine: DeepSpeedEngine, exclude_frozen: bool, client_state: dict[str, Any],
                  rng_states: list[dict[str, Any]]) -> dict[str, Any]:
    module = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen)
    zero = engine._zero.stage > 0
    shapes = None
    if zero:
        names = {id(p): n for n, p in engine.module.named_parameters()}
        shapes = [{names[id(p)]: p.shape for p in g["params"] if id(p) in names}
                  for g in engine.basic_optimizer.param_groups] if engine.basic_optimizer is not None else None
    state: dict[str, Any] = {
        "module": module,
        "buffer_names": [n for n, _ in engine.module.named_buffers()],
        "optimizer": engine._stepper.state_dict() if not zero and engine._stepper is not None else None,
        "param_shapes": shapes,
        "frozen_param_shapes": None,
        "shared_params": None,
        "frozen_param_fragments": None,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "data_sampler": None,
        "random_ltd": None,
        "skipped_steps": engine.skipped_steps,
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "micro_steps": engine.micro_steps,
        "dp_world_size": engine.dp_world_size,
        "mp_world_size": engine.mp_world_size,
        "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": engine.mp_world_size},
        "ds_config": engine._ds_config.raw,
        "ds_version": __version__,
        "rng_states": rng_states,
    }
    return with_client_state(state, client_state)


def with_client_state(state: dict[str, Any], client_state: dict[str, Any]) -> dict[str, Any]:
    """`state` plus the user's `client_state`; a key the engine writes itself is an error, not overwritten."""
    clash = sorted(set(client_state) & set(state))
    if clash:
        raise ValueError(f"client_state keys {clash} collide with keys the engine writes; rename them")
    state.update(client_state)
    return state


def resolve_save_tag(engine: DeepSpeedEngine, save_dir: str | Path, tag: Any) -> str:
    """The tag to save under (default `global_step<N>`), checked to be a plain name every rank agrees on."""
    if not save_dir:
        raise ValueError(f"save_checkpoint: save_dir must be a directory path, got {save_dir!r}")
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    if not tag or "/" in tag or tag in (".", ".."):
        raise ValueError(f"save_checkpoint: tag must be a plain directory name, got {tag!r}")
    _check_tag(engine, tag)
    return tag


def save_checkpoint(engine: DeepSpeedEngine, save_dir: str | Path, tag: Any = None,
                    client_state: dict[str, Any] | None = None, save_latest: bool = True,
                    exclude_frozen_parameters: bool = False) -> bool:
    """See `DeepSpeedEngine.save_checkpoint`."""
    tag = resolve_save_tag(engine, save_dir, tag)
    root = Path(save_dir)
    ckpt_dir = root / tag
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    serialization = engine._ckpt_config.checkpoint_serialization
    rng_states = _gather_rng(engine)
    if engine._dp_rank == 0:
        state = _model_states(engine, exclude_frozen_parameters, dict(client_state or {}), rng_states)
        atomic_save(state, _model_file(ckpt_dir, engine._mp_rank), serialization=serialization)
    if engine._zero.stage > 0:
        zero_state = {"optimizer_state_dict": engine._stepper.state_dict(), "ds_config": engine._ds_config.raw,
                      "ds_version": __version__}
        atomic_save(zero_state, _zero_file(ckpt_dir, engine._dp_rank, engine._mp_rank), serialization=serialization)
    _barrier()
    if save_latest and engine.global_rank == 0:
        atomic_write_text(root / "latest", tag)
    _barrier()
    logger.info("saved checkpoint %s", ckpt_dir)
    return True


def _barrier() -> None:
    if ds_comm.is_initialized() and ds_comm.get_world_size() > 1:
        ds_comm.barrier()


def _rank_of(path: Path) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_", path.name)
    return int(match.group(1)) if match else -1


def _zero_files(ckpt_dir: Path, mp_rank: int) -> list[Path]:
    files = sorted(ckpt_dir.glob(f"zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt"), key=_rank_of)
    if not files:
        files = sorted(ckpt_dir.glob(f"bf16_zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt"), key=_rank_of)
    if not files:
        raise FileNotFoundError(f"no ZeRO optimizer files (zero_pp_rank_*_mp_rank_{mp_rank:02d}_optim_states.pt) in "
                                f"{ckpt_dir}; was it saved with ZeRO? Load with load_optimizer_states=False to "
                                "take the module weights only")
    return files


def _load_optimizer(engine: DeepSpeedEngine, state: dict[str, Any], ckpt_dir: Path,
                    load_optimizer_states: bool) -> None:
    fp32 = engine._zero.load_from_fp32_weights
    if engine._stepper is None:
        return
    if not load_optimizer_states:
        engine._stepper.refresh_from_module()
    elif engine._zero.stage > 0:
        parts = [torch.load(f, map_location="cpu", weights_only=False)["optimizer_state_dict"]
                 for f in _zero_files(ckpt_dir, engine._mp_rank)]
        engine._stepper.load_partitions(parts, load_optimizer_states=True, load_from_fp32_weights=fp32)
    elif state.get("optimizer") is not None:
        engine._stepper.load_state_dict(state["optimizer"], load_from_fp32_weights=fp32)
    else:
        logger.warning("checkpoint %s has no stage-0 optimizer state (saved with ZeRO?); optimizer not restored",
                       ckpt_dir)
        engine._stepper.refresh_from_module()


def load_checkpoint(engine: DeepSpeedEngine, load_dir: str | Path, tag: Any = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False,
                    custom_load_fn: Any = None) -> tuple[str | None, dict[str, Any] | None]:
    """See `DeepSpeedEngine.load_checkpoint`."""
    root = Path(load_dir)
    if tag is None:
        latest = root / "latest"
        if not latest.is_file():
            logger.warning("load_checkpoint: no 'latest' file in %s; nothing loaded (pass tag= to pick one)", root)
            return None, None
        tag = latest.read_text().strip()
    ckpt_dir = root / str(tag)
    path = _model_file(ckpt_dir, engine._mp_rank)
    if not path.is_file():
        raise FileNotFoundError(f"load_checkpoint: {path} does not exist (tag {str(tag)!r} in {root})")
    state = torch.load(path, map_location="cpu", weights_only=False)
    if custom_load_fn is not None:
        custom_load_fn(src=state["module"], dst=engine.module)
    else:
        engine.load_module_state_dict(state["module"], strict=load_module_strict)
    if load_module_only:
        if engine._stepper is not None:
            engine._stepper.refresh_from_module()
    else:
        _load_optimizer(engine, state, ckpt_dir, load_optimizer_states)
        if load_lr_scheduler_states and engine.lr_scheduler is not None and state.get("lr_scheduler") is not None:
            engine.lr_scheduler.load_state_dict(state["lr_scheduler"])
        engine.global_steps = int(state["global_steps"])
        engine.global_samples = int(state.get("global_samples", engine.global_steps * engine.train_batch_size()))
        engine.skipped_steps = int(state.get("skipped_steps", 0))
        engine.micro_steps = int(state.get("micro_steps", engine.global_steps * engine.gradient_accumulation_steps()))
        rng = state.get("rng_states")
        if rng:
            if len(rng) == engine.world_size:
                _set_rng_state(rng[engine.global_rank])
            else:
                logger.warning("checkpoint RNG states are for %d ranks, this run has %d; RNG not restored",
                               len(rng), engine.world_size)
    client_state = {k: v for k, v in state.items() if k not in _ENGINE_KEYS}
    return str(path), client_state


def save_16bit_model(engine: DeepSpeedEngine, save_dir: str | Path, save_filename: str = "pytorch_model.bin",
                     exclude_frozen_parameters: bool = False) -> bool:
    """See `DeepSpeedEngine.save_16bit_model`.

    At stage 3 the full weights are assembled by `ds_zero.consolidated_16bit_state_dict`, which gathers
    one module's parameters at a time (the whole model is never gathered at once on any rank) and
    copies them to the CPU on rank 0. Without `stage3_gather_16bit_weights_on_model_save` nothing is
    written and False is returned (DeepSpeed does the same: the partitioned state_dict would be bogus).
    """
    if engine._zero.stage == 3:
        if not engine._zero.gather_16bit_weights_on_model_save:
            logger.warning("save_16bit_model: nothing saved; under ZeRO stage 3 the parameters are partitioned, set "
                           "zero_optimization.stage3_gather_16bit_weights_on_model_save=true to gather and save them")
            return False
        ds_zero = require("ds_zero", extra="zero", feature="ZeRO stage 3 save_16bit_model")
        state = ds_zero.consolidated_16bit_state_dict(engine.module, rank0_only=True,
                                                      exclude_frozen_parameters=exclude_frozen_parameters)
    else:
        state = engine.module_state_dict(exclude_frozen_parameters=exclude_frozen_parameters) \
            if engine.global_rank == 0 else {}
    if engine.global_rank == 0:
        path = Path(save_dir)
        path.mkdir(parents=True, exist_ok=True)
        atomic_save(state, path / save_filename, serialization=engine._ckpt_config.checkpoint_serialization)
    _barrier()
    return True
