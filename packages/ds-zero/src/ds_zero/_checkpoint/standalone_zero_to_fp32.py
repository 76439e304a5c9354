#!/usr/bin/env python
"""Rebuild full fp32 weights from a ZeRO checkpoint: needs only torch (copied next to each checkpoint).

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [--max_shard_size 5GB] [--safe_serialization]
                           [-t TAG] [--exclude_frozen_parameters] [-d]

DeepSpeed's arguments and output: `CHECKPOINT_DIR` holds `latest` (or is a tag directory); OUTPUT_DIR
(created) gets `pytorch_model.bin` (`model.safetensors` with --safe_serialization, which needs the
safetensors package), or numbered shards and an `.index.json` when the weights exceed --max_shard_size.
Every trainable parameter comes in fp32 from the optimizer partitions of all ranks; frozen parameters
and buffers from the model-states files (a DeepSpeed stage-3 checkpoint keeps the frozen ones sliced
over every rank's file); tied parameters get their stored twin. Reads ds's files and DeepSpeed 0.19.8's
(ZeRO 1-3) without ds or DeepSpeed installed: files are loaded with torch's `weights_only` unpickler;
DeepSpeed's few pickled classes are read as plain attribute holders. `zero_to_torch.py` beside it
writes the same in fp16 or bf16.

This file is written by ds (ds-zero's `_checkpoint/standalone_zero_to_fp32.py`); it must stay free of ds imports.
"""

from __future__ import annotations

import argparse
import enum
import json
import math
import re
import sys
from pathlib import Path

import torch

_OPTIM = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_?optim_states\.pt$")
_STAGE3_MODEL = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
OUTPUT_DTYPE_NAMES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
debug = False


class _Attrs:
    def __setstate__(self, state):
        self.__dict__.update(state)


class _Stage(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


_ALLOWED = [
    (_Stage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_Attrs, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (type("_Dyn", (_Attrs,), {}), "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (type("_Addr", (_Attrs,), {}), "deepspeed.utils.tensor_fragment.fragment_address"),
]


def _fail(message):
    raise SystemExit(f"zero_to_fp32: {message}")


def _log(message):
    if debug:
        print(message, file=sys.stderr)


def _load(path):
    try:
        import numpy as np  # ds keeps numpy's RNG state in the model states

        core = getattr(np, "_core", None) or np.core
        extra = [np.ndarray, np.dtype, (core.multiarray._reconstruct, f"{core.__name__}.multiarray._reconstruct")]
        extra += [getattr(np.dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(np, "dtypes")]
    except ImportError:
        extra = []
    try:
        with torch.serialization.safe_globals(_ALLOWED + extra):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001  # any unreadable file ends the script with its name
        _fail(f"cannot read {path}: {str(err).splitlines()[0]}")


def _tag_dir(root, tag):
    root = Path(root)
    if tag is None and (root / "latest").is_file():
        tag = (root / "latest").read_text().strip()
    path = root / tag if tag is not None else root
    if not path.is_dir():
        _fail(f"no checkpoint directory {path}")
    return path


def _ranked(ckpt, pattern):
    files = {int(m.group(1)): p for p in ckpt.iterdir() if (m := pattern.match(p.name))}
    if sorted(files) != list(range(len(files))):
        _fail(f"{ckpt}: files for ranks {sorted(files)}; a rank's file is missing")
    return [files[r] for r in range(len(files))]


def _from_ds(sds):
    """ds's format: each partition lists its fragments [name, param_start, numel, partition_start]."""
    shapes, out = {}, {}
    for sd in sds:
        for meta in sd["partitions"]:
            shapes.update({n: tuple(s) for n, s in meta["param_shapes"].items()})
    for name, shape in shapes.items():
        out[name] = torch.zeros(math.prod(shape), dtype=torch.float32)
    filled = dict.fromkeys(shapes, 0)
    for sd in sds:
        for k, meta in enumerate(sd["partitions"]):
            flat = sd["single_partition_of_fp32_groups"][k]
            for name, p0, n, s0 in meta["fragments"]:
                out[name][p0 : p0 + n] = flat[s0 : s0 + n].float()
                filled[name] += n
    short = [n for n in shapes if filled[n] != math.prod(shapes[n])]
    if short:
        _fail(f"parameters {short[:3]} are not fully covered; a rank's file is missing")
    return {n: t.view(shapes[n]) for n, t in out.items()}


def _take(flats, lo, numel):
    """Elements [lo, lo + numel) of one rank's flat groups laid end to end (a slice may cross groups)."""
    pieces, start = [], 0
    for flat in flats:
        a, b = max(lo, start), min(lo + numel, start + flat.numel())
        if a < b:
            pieces.append(flat[a - start : b - start].float())
        start += flat.numel()
    return torch.cat(pieces) if pieces else torch.zeros(0)


def _from_deepspeed_stage3(sds, param_shapes):
    """Each parameter cut on its own: ceil(numel / world) elements per rank, one after another in
    param_shapes order (every param group's) through the rank's flat groups."""
    world = len(sds)
    flats = [sd["fp32_flat_groups"] for sd in sds]
    out, at = {}, 0
    for shapes in param_shapes:
        for name, shape in shapes.items():
            numel = math.prod(shape)
            per_rank = -(-numel // world)
            out[name] = torch.cat([_take(f, at, per_rank) for f in flats])[:numel].view(tuple(shape)).clone()
            at += per_rank
    held = sum(f.numel() for f in flats[0])
    if at != held:
        _fail(f"param_shapes account for {at} elements per rank, the optimizer files hold {held}")
    return out


def _from_deepspeed(sds, param_shapes):
    """DeepSpeed's format: stage 1/2 flat groups cut in rank order; stage 3 each parameter cut on its own."""
    if "fp32_flat_groups" in sds[0]:
        return _from_deepspeed_stage3(sds, param_shapes)
    out = {}
    paddings = sds[0].get("param_alignment_paddings") or []
    for g, shapes in enumerate(param_shapes):
        flat = torch.cat([sd["single_partition_of_fp32_groups"][g].float() for sd in sds])
        pads = list(paddings[g]) if g < len(paddings) and len(paddings[g]) == len(shapes) else [0] * len(shapes)
        at = 0
        for (name, shape), pad in zip(shapes.items(), pads, strict=True):
            numel = math.prod(shape)
            out[name] = flat[at : at + numel].view(tuple(shape)).clone()
            at += numel + int(pad)
    return out


def _frozen(ckpt, states):
    """Frozen parameters from `frozen_param_fragments`: whole (one file), or sliced over every rank's file."""
    if not states[0].get("frozen_param_fragments"):  # whole in the module (ds's own saves)
        return {}
    shapes = states[0].get("frozen_param_shapes") or {}
    out = {}
    for name, shape in shapes.items():
        flat = torch.cat([s["frozen_param_fragments"][name].reshape(-1) for s in states])
        out[name] = flat[: math.prod(shape)].view(tuple(shape)).clone()
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None, exclude_frozen_parameters=False):
    """The consolidated state_dict, in the module's key order: fp32 trainable parameters, frozen parameters
    in fp32 (unless excluded), buffers as saved, tied parameters sharing their twin's tensor."""
    ckpt = _tag_dir(checkpoint_dir, tag)
    files = _ranked(ckpt, _OPTIM)
    if not files:
        _fail(f"{ckpt} has no zero_pp_rank_*_optim_states.pt files; stage-0 checkpoints hold full weights already")
    sds = [_load(f)["optimizer_state_dict"] for f in files]
    model_files = _ranked(ckpt, _STAGE3_MODEL) or [p for p in [ckpt / "mp_rank_00_model_states.pt"] if p.is_file()]
    states = [_load(p) for p in model_files] or [{}]
    first = states[0]
    _log(f"{ckpt}: {len(sds)} optimizer files, {len(model_files)} model-states files")
    if "ds_zero_format" in sds[0]:
        params = _from_ds(sds)
    else:
        if not first.get("param_shapes"):
            _fail(f"{ckpt} has no model-states file with param_shapes")
        params = _from_deepspeed(sds, first["param_shapes"])
    buffers = set(first.get("buffer_names") or [])
    frozen = {n: v.float() if v.is_floating_point() else v for n, v in _frozen(ckpt, states).items()}
    shared = first.get("shared_params") or {}
    result = {}
    for name, value in (first.get("module") or {}).items():
        stored = shared.get(name, name)
        if stored in params:
            result[name] = params[stored]
        elif name in buffers:
            result[name] = value
        elif exclude_frozen_parameters:
            continue
        elif stored in frozen:
            result[name] = frozen[stored]
        elif isinstance(value, torch.Tensor) and value.numel() > 0:  # a frozen parameter of a ds save
            result[name] = value.float() if value.is_floating_point() else value
    for name, value in params.items():
        result.setdefault(name, value)
    return result


def _shards(state_dict, limit):
    """Names per shard in order; tensors sharing storage (tied) stay together and are counted once."""
    groups = {}
    for name, value in state_dict.items():
        groups.setdefault(value.untyped_storage().data_ptr(), []).append(name)
    shards, filled = [[]], 0
    for names in groups.values():
        size = state_dict[names[0]].untyped_storage().nbytes()
        if limit is not None and shards[-1] and filled + size > limit:
            shards, filled = [*shards, []], 0
        shards[-1].extend(names)
        filled += size
    return shards


def _parse_size(size):
    if size is None or isinstance(size, int):
        return size
    match = re.match(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*$", str(size), re.IGNORECASE)
    if not match:
        _fail(f"--max_shard_size {size!r}: give a size such as 5GB or 500MB")
    unit = (match.group(2) or "B").upper()
    scale = 1 if unit == "B" else (2**10 if "I" in unit else 10**3) ** ("KMGT".index(unit[0]) + 1)
    return int(float(match.group(1)) * scale)


def _save(tensors, path, safe):
    if not safe:
        torch.save(tensors, path)
        return
    try:
        from safetensors.torch import save_file
    except ImportError:
        _fail("--safe_serialization needs the safetensors package: pip install safetensors")
    seen, own = set(), {}
    for name, t in tensors.items():  # safetensors stores no shared tensors: later names get a copy
        key = t.untyped_storage().data_ptr()
        own[name] = t.contiguous() if key not in seen else t.clone().contiguous()
        seen.add(key)
    save_file(own, str(path), metadata={"format": "pt"})


def convert_zero_checkpoint_to_state_dict(
    checkpoint_dir,
    output_dir,
    dtype=torch.float32,
    max_shard_size="5GB",
    safe_serialization=False,
    tag=None,
    exclude_frozen_parameters=False,
):
    """Write the consolidated weights into `output_dir` with floating-point tensors in `dtype` (a torch
    dtype or one of OUTPUT_DTYPE_NAMES), as DeepSpeed lays them out. Returns the files written."""
    if isinstance(dtype, str):
        if dtype.removeprefix("torch.").lower() not in OUTPUT_DTYPE_NAMES:
            _fail(f"dtype {dtype!r}: choose one of {', '.join(sorted(OUTPUT_DTYPE_NAMES))}")
        dtype = OUTPUT_DTYPE_NAMES[dtype.removeprefix("torch.").lower()]
    out = Path(output_dir)
    if out.suffix in (".bin", ".pt", ".pth", ".safetensors") and not out.is_dir():
        _fail(f"{out} looks like a file name; OUTPUT_DIR is the directory that receives the weights")
    if out.exists() and not out.is_dir():
        _fail(f"{out} is an existing file; OUTPUT_DIR must be a directory")
    limit = _parse_size(max_shard_size)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag, exclude_frozen_parameters)
    cast = {}
    for name, value in state.items():
        if value.is_floating_point() and value.dtype != dtype:
            state[name] = cast.setdefault(id(value), value.to(dtype))
    out.mkdir(parents=True, exist_ok=True)
    base = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    shards = _shards(state, limit)
    stem, _, suffix = base.rpartition(".")
    names = (
        [base]
        if len(shards) == 1
        else [f"{stem}-{i:05d}-of-{len(shards):05d}.{suffix}" for i in range(1, len(shards) + 1)]
    )
    for shard, file in zip(shards, names, strict=True):
        members = set(shard)
        _save({n: v for n, v in state.items() if n in members}, out / file, safe_serialization)  # module order
    if len(shards) > 1:
        total = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in state.values()}.values())
        weight_map = {n: file for shard, file in zip(shards, names, strict=True) for n in shard}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / f"{base}.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        names.append(f"{base}.index.json")
    print(f"saved {len(state)} tensors to {out} ({', '.join(names)})", file=sys.stderr)
    return [out / n for n in names]


def convert_zero_checkpoint_to_fp32_state_dict(
    checkpoint_dir,
    output_dir,
    max_shard_size="5GB",
    safe_serialization=False,
    tag=None,
    exclude_frozen_parameters=False,
):
    """`convert_zero_checkpoint_to_state_dict` in fp32 (DeepSpeed's name and argument order)."""
    return convert_zero_checkpoint_to_state_dict(
        checkpoint_dir, output_dir, torch.float32, max_shard_size, safe_serialization, tag, exclude_frozen_parameters
    )


def add_common_arguments(parser):
    """The arguments this script and zero_to_torch.py share (DeepSpeed's)."""
    parser.add_argument("checkpoint_dir", help="the save directory (holding 'latest') or a tag directory")
    parser.add_argument("output_dir", help="directory that receives pytorch_model.bin (or shards and an index)")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, such as 5GB or 500MB (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true", help="write model.safetensors")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag (default: read from 'latest')")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="leave out frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="say which files are read")


def main(argv=None):
    global debug
    parser = argparse.ArgumentParser(description="Consolidate a ZeRO checkpoint into fp32 weights.")
    add_common_arguments(parser)
    args = parser.parse_args(argv)
    debug = args.debug
    convert_zero_checkpoint_to_fp32_state_dict(
        args.checkpoint_dir,
        args.output_dir,
        max_shard_size=args.max_shard_size,
        safe_serialization=args.safe_serialization,
        tag=args.tag,
        exclude_frozen_parameters=args.exclude_frozen_parameters,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
