"""Reading checkpoint files safely, also ones DeepSpeed wrote, without DeepSpeed installed.

DeepSpeed's files pickle a few of its own classes (the loss scaler, `ZeroStageEnum`,
`fragment_address`). Loading them with `torch.load(weights_only=False)` would need `deepspeed`
importable and would run whatever a file's pickle says. `load_checkpoint_file` instead uses torch's
`weights_only` unpickler (tensors, containers, plain values only) with an allow-list that maps exactly
those DeepSpeed class paths onto the plain stand-ins below: nothing else a file names is built or run.

Every failure names the file and says what is wrong with it (missing, truncated or not a torch
checkpoint, a class outside the allow-list, a newer DeepSpeed than this reader knows), and nothing is
returned half loaded: the whole file is parsed before the caller sees any of it.
"""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import types
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "DEEPSPEED_READ_VERSION",
    "CheckpointFileError",
    "DeepSpeedDynamicLossScaler",
    "DeepSpeedFragmentAddress",
    "DeepSpeedLossScaler",
    "DeepSpeedZeroStage",
    "check_deepspeed_version",
    "deepspeed_pickle_names",
    "load_checkpoint_file",
]

#: The newest DeepSpeed release whose checkpoint layout this reader was checked against.
DEEPSPEED_READ_VERSION = (0, 19, 8)


class CheckpointFileError(ValueError):
    """A checkpoint file that cannot be read: the message names the file and the problem."""


class DeepSpeedZeroStage(enum.IntEnum):
    """Stand-in for `deepspeed.runtime.zero.config.ZeroStageEnum` (an int enum: the ZeRO stage)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


class _PlainState:
    """A pickled object restored as its attribute dict only (no methods of the original run)."""

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict):
            raise CheckpointFileError(f"{type(self).__name__}: expected a dict of attributes, got {type(state)}")
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.__dict__})"


class DeepSpeedLossScaler(_PlainState):
    """Stand-in for DeepSpeed's `LossScaler` / `DynamicLossScaler`: their attributes (`cur_scale`, ...)."""

    def state_dict(self) -> dict[str, Any]:
        """`cur_scale` and `dynamic`, plus the dynamic scaler's counters when it has them."""
        return dict(self.__dict__)


class DeepSpeedDynamicLossScaler(DeepSpeedLossScaler):
    """Stand-in for DeepSpeed's `DynamicLossScaler` (fp16 with a dynamic scale)."""


class DeepSpeedFragmentAddress(_PlainState):
    """Stand-in for `deepspeed.utils.tensor_fragment.fragment_address`: `numel` and `start` of a slice."""

    numel: int
    start: int


_DEEPSPEED_CLASSES: list[tuple[Any, str]] = [
    (DeepSpeedZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (DeepSpeedLossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DeepSpeedDynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (DeepSpeedFragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


@contextlib.contextmanager
def deepspeed_pickle_names() -> Iterator[None]:
    """While active, `torch.save` writes the stand-ins under DeepSpeed's class paths.

    So a file ds writes for DeepSpeed holds the loss scaler, `ZeroStageEnum` and `fragment_address`
    where DeepSpeed's own unpickler looks for them. pickle checks that a class is importable under its
    name, and Python's import of a dotted name imports its top package too; so for the duration, each
    DeepSpeed module path (and each parent of it) that is not already imported gets an empty placeholder
    module, the leaf holding just the stand-in; all are removed afterwards, so a later `import deepspeed`
    finds the real one if installed. Where such a module is really imported (ds's `deepspeed` alias, or
    DeepSpeed), its own class is shadowed by the stand-in for the duration and put back afterwards. Not
    thread-safe: the stand-ins' names (and the placeholders) are visible to the whole process while it is
    active.
    """
    saved = []
    added = []
    shadowed: list[tuple[types.ModuleType, str, Any]] = []
    try:
        for cls, full in _DEEPSPEED_CLASSES:
            module, _, name = full.rpartition(".")
            saved.append((cls, cls.__module__, cls.__qualname__, cls.__name__))
            parts = module.split(".")
            for depth in range(1, len(parts) + 1):
                prefix = ".".join(parts[:depth])
                if prefix not in sys.modules:
                    sys.modules[prefix] = types.ModuleType(prefix, "placeholder for pickling ds's stand-ins")
                    added.append(prefix)
            target = sys.modules[module]
            if hasattr(target, name) and getattr(target, name) is not cls:
                # the module is really imported (ds's `deepspeed` alias, or DeepSpeed itself): its class is
                # put back afterwards; pickle only needs the name to resolve to the stand-in while saving
                shadowed.append((target, name, getattr(target, name)))
            setattr(target, name, cls)
            cls.__module__, cls.__qualname__, cls.__name__ = module, name, name
        yield
    finally:
        for cls, module, qualname, name in saved:
            cls.__module__, cls.__qualname__, cls.__name__ = module, qualname, name
        for target, name, original in reversed(shadowed):
            setattr(target, name, original)
        for module in reversed(added):
            sys.modules.pop(module, None)


def _numpy_globals() -> list[Any]:
    """numpy's array reconstruction, when numpy is there: ds's own files keep numpy's RNG state."""
    try:
        import numpy as np
    except ImportError:
        return []
    core = getattr(np, "_core", None) or np.core
    return [
        np.ndarray,
        np.dtype,
        (core.multiarray._reconstruct, f"{core.__name__}.multiarray._reconstruct"),
        *(getattr(np.dtypes, n) for n in ("UInt32DType", "Int64DType", "Float64DType") if hasattr(np, "dtypes")),
    ]


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts)


def check_deepspeed_version(version: Any, path: str | os.PathLike[str]) -> None:
    """Refuse a file written by a DeepSpeed newer than `DEEPSPEED_READ_VERSION` (its layout may differ).

    Raises:
        CheckpointFileError: names the file, its version and the newest one this reader knows.
    """
    if not isinstance(version, str) or not version:
        return
    if _version_tuple(version)[:3] > DEEPSPEED_READ_VERSION:
        known = ".".join(map(str, DEEPSPEED_READ_VERSION))
        raise CheckpointFileError(
            f"{path}: written by DeepSpeed {version}, newer than the newest layout this ds reads (DeepSpeed "
            f"{known}); convert it with that DeepSpeed's ds_to_universal or save it from DeepSpeed {known}"
        )


def load_checkpoint_file(path: str | os.PathLike[str], *, mmap: bool = False) -> Any:
    """`torch.load` a checkpoint file (ds's or DeepSpeed's) on the CPU, restricted to the allow-list.

    Raises:
        FileNotFoundError: there is no such file.
        CheckpointFileError: the file is empty, truncated or corrupt, not a torch checkpoint, or pickles
            a class outside the allow-list (the message names the file and the class).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint file {path} does not exist")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointFileError(f"{path}: the file is empty (0 bytes); the save that wrote it did not finish")
    if zipfile.is_zipfile(path):
        _check_zip(path)
    try:
        with torch.serialization.safe_globals(_DEEPSPEED_CLASSES + _numpy_globals()):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap and zipfile.is_zipfile(path))
    except CheckpointFileError:
        raise
    except Exception as err:  # torch raises several types for a bad file; one clear error for all
        lines = str(err).splitlines() or [type(err).__name__]
        text = next((ln.strip() for ln in lines if "GLOBAL" in ln), lines[0])
        if "Unsupported global" in str(err) or "Weights only load failed" in str(err):
            raise CheckpointFileError(
                f"{path}: refers to a Python object outside the allow-list of checkpoint classes ({text}); "
                "ds does not run arbitrary pickled code"
            ) from err
        raise CheckpointFileError(
            f"{path}: not a readable torch checkpoint ({size} bytes): {text}; the file is truncated or corrupt"
        ) from err


def _check_zip(path: Path) -> None:
    """Verify every member's CRC, so a damaged tensor blob is reported instead of loaded."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as err:
        raise CheckpointFileError(
            f"{path}: the zip archive is damaged ({err}); the file is truncated or corrupt"
        ) from err
    if bad is not None:
        raise CheckpointFileError(f"{path}: member {bad!r} fails its CRC check; the file is corrupt")
