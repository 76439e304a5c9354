#!/usr/bin/env python
"""Rebuild full fp32 weights from a ZeRO checkpoint: needs only torch (copied next to each checkpoint).

    python zero_to_fp32.py CHECKPOINT_DIR OUTPUT_DIR [-t TAG]

`CHECKPOINT_DIR` holds `latest` (or is a tag directory); OUTPUT_DIR (created) gets one `torch.save`d
`pytorch_model.bin`, unsharded (DeepSpeed's argument order; `ds-zero-to-fp32` also shards and writes
safetensors): every trainable parameter in fp32 from the optimizer
partitions of all ranks, buffers and frozen parameters from the model-states file. Reads ds's files
and DeepSpeed 0.19.8's (ZeRO 1-3) without ds or DeepSpeed installed: files are loaded with torch's
`weights_only` unpickler; DeepSpeed's few pickled classes are read as plain attribute holders.

This file is written by ds (ds-zero's `_checkpoint/standalone_zero_to_fp32.py`); it must stay free of ds imports.
"""

from __future__ import annotations

import argparse
import enum
import math
import re
import sys
from pathlib import Path

import torch

_OPTIM = re.compile(r"^(?:bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_00_?optim_states\.pt$")


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
    except Exception as err:
        raise SystemExit(f"zero_to_fp32: cannot read {path}: {str(err).splitlines()[0]}") from err


def _tag_dir(root, tag):
    root = Path(root)
    if tag is None and (root / "latest").is_file():
        tag = (root / "latest").read_text().strip()
    path = root / tag if tag is not None else root
    if not path.is_dir():
        raise SystemExit(f"zero_to_fp32: no checkpoint directory {path}")
    return path


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
        raise SystemExit(f"zero_to_fp32: parameters {short[:3]} are not fully covered; a rank's file is missing")
    return {n: t.view(shapes[n]) for n, t in out.items()}


def _from_deepspeed(sds, param_shapes):
    """DeepSpeed's format: stage 1/2 flat groups cut in rank order; stage 3 each parameter cut on its own."""
    world = len(sds)
    out = {}
    if "fp32_flat_groups" in sds[0]:
        offsets = [0] * world
        for shapes in param_shapes:
            for name, shape in shapes.items():
                numel = math.prod(shape)
                per_rank = -(-numel // world)
                pieces = [
                    sd["fp32_flat_groups"][0].float()[offsets[r] : offsets[r] + per_rank] for r, sd in enumerate(sds)
                ]
                offsets = [o + per_rank for o in offsets]
                out[name] = torch.cat(pieces)[:numel].view(tuple(shape)).clone()
        return out
    for g, shapes in enumerate(param_shapes):
        flat = torch.cat([sd["single_partition_of_fp32_groups"][g].float() for sd in sds])
        at = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            out[name] = flat[at : at + numel].view(tuple(shape)).clone()
            at += numel
    return out


def get_fp32_state_dict(checkpoint_dir, tag=None):
    """The consolidated state_dict (fp32 parameters, buffers and frozen parameters as saved)."""
    ckpt = _tag_dir(checkpoint_dir, tag)
    files = {int(m.group(1)): p for p in ckpt.iterdir() if (m := _OPTIM.match(p.name))}
    if not files or sorted(files) != list(range(len(files))):
        raise SystemExit(
            f"zero_to_fp32: {ckpt} lacks a complete set of zero_pp_rank_*_optim_states.pt files "
            f"(found ranks {sorted(files)}); stage-0 checkpoints hold full weights already"
        )
    sds = [_load(files[r])["optimizer_state_dict"] for r in range(len(files))]
    states_path = next(
        (
            ckpt / n
            for n in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")
            if (ckpt / n).is_file()
        ),
        None,
    )
    states = _load(states_path) if states_path else {}
    if "ds_zero_format" in sds[0]:
        params = _from_ds(sds)
    else:
        if not states.get("param_shapes"):
            raise SystemExit(f"zero_to_fp32: {ckpt} has no model-states file with param_shapes")
        params = _from_deepspeed(sds, states["param_shapes"])
    result = {}
    for name, value in (states.get("module") or {}).items():
        if name in params:
            result[name] = params[name]
        elif isinstance(value, torch.Tensor) and value.numel() == 0:
            continue
        else:
            result[name] = (
                value.float() if value.is_floating_point() and name not in states.get("buffer_names", []) else value
            )
    for name, value in params.items():
        result.setdefault(name, value)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description="Consolidate a ZeRO checkpoint into one fp32 state_dict.")
    parser.add_argument("checkpoint_dir")
    parser.add_argument("output_dir", help="directory that receives pytorch_model.bin")
    parser.add_argument("-t", "--tag", default=None)
    args = parser.parse_args(argv)
    out = Path(args.output_dir)
    if out.suffix in (".bin", ".pt", ".pth", ".safetensors") and not out.is_dir():
        parser.error(f"{out} looks like a file name; OUTPUT_DIR is the directory that receives pytorch_model.bin")
    if out.exists() and not out.is_dir():
        parser.error(f"{out} is an existing file; OUTPUT_DIR must be a directory")
    state = get_fp32_state_dict(args.checkpoint_dir, args.tag)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(state, out / "pytorch_model.bin")
    print(f"saved {len(state)} tensors to {out / 'pytorch_model.bin'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
