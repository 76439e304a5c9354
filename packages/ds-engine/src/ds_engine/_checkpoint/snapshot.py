"""`SnapshotPool`: the copy a decoupled save writes from, into memory kept from the previous save.

A decoupled save copies each file's state before training goes on (`_checkpoint.decoupled`). `copy.deepcopy`
alone would allocate fresh memory for every save, and on a busy host the page faults of a gigabyte of new
memory cost more than the copy itself. The pool keeps the storages the last save was copied into and hands
them out again (same size, same device); then a save is one memory copy per storage.

The copy is a `copy.deepcopy` whose memo already maps each storage of the state to its pooled copy, so
tensors that share a storage (tied weights, views into a flat buffer) still share one, with the same offsets
and strides: the file is byte for byte what a synchronous save writes. Tensors the walk does not reach
(inside objects other than containers and plain objects) are cloned by deepcopy as usual.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch

__all__ = ["SnapshotPool"]

_Key = tuple[int, str]


def _storages(obj: Any, out: dict[int, torch.UntypedStorage], seen: set[int]) -> None:
    """Every distinct storage of the tensors in `obj` (dicts, lists, tuples, sets and plain objects walked)."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        # plain strided tensors only: a Parameter's deepcopy clones its data rather than ask the memo
        if type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type != "meta":
            storage = obj.untyped_storage()
            out.setdefault(storage._cdata, storage)
        return
    if isinstance(obj, dict):
        for value in obj.values():
            _storages(value, out, seen)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            _storages(value, out, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        _storages(vars(obj), out, seen)


class SnapshotPool:
    """Copies states into storages reused from the previous save (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._free: dict[_Key, list[torch.UntypedStorage]] = {}
        self._taken: set[int] = set()  # ids of the storages snapshots used since the last trim
        self._lock = threading.Lock()

    def snapshot(self, obj: Any) -> tuple[Any, list[torch.UntypedStorage]]:
        """A deep copy of `obj` and the pooled storages it uses (hand them back with `give_back` once written).

        Raises:
            Whatever `copy.deepcopy` raises for an object it cannot copy (the storages taken go back).
        """
        found: dict[int, torch.UntypedStorage] = {}
        _storages(obj, found, set())
        memo: dict[int, torch.UntypedStorage] = {}
        used: list[torch.UntypedStorage] = []
        for cdata, storage in found.items():
            target = self._take((storage.nbytes(), str(storage.device)))
            if target is None:
                target = torch.UntypedStorage(storage.nbytes(), device=storage.device)
            target.copy_(storage)
            memo[cdata] = target
            used.append(target)
        with self._lock:
            self._taken.update(id(s) for s in used)
        try:
            seeded: dict[Any, Any] = {"torch": memo}  # torch's storage deepcopy looks here first
            return copy.deepcopy(obj, seeded), used
        except Exception:
            self.give_back(used)
            raise

    def give_back(self, storages: list[torch.UntypedStorage]) -> None:
        """`storages` are written; the next snapshot may copy into them."""
        with self._lock:
            for s in storages:
                self._free.setdefault((s.nbytes(), str(s.device)), []).append(s)

    def trim(self) -> None:
        """Drop the free storages no snapshot used since the last trim (the saved state changed shape)."""
        with self._lock:
            self._free = {
                key: kept for key, free in self._free.items() if (kept := [s for s in free if id(s) in self._taken])
            }
            self._taken = set()

    def _take(self, key: _Key) -> torch.UntypedStorage | None:
        with self._lock:
            free = self._free.get(key)
            return free.pop() if free else None
