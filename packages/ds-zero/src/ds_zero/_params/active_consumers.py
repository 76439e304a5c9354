"""`param.ds_active_sub_modules`: a read-only view of who is using a partitioned parameter's full values now.

[Note: why a view and not a set]
DeepSpeed keeps a mutable set of module ids on each parameter and adds/removes ids around every
forward and backward. Code written for it (and its tests) reads that set to check that nothing still
holds a parameter after a backward, a checkpoint replay or an aborted step. ds already counts the claims
in one place (`ZeroParamState.active`, written by the coordinator); a second copy kept in a set would have
to be kept in sync with it. This view reads the count and asks the owning coordinator for names, so it is
always current, cannot be written, and is empty exactly when no running module, open
`GatheredParameters` block or end-of-iteration hold claims the parameter.
"""

from __future__ import annotations

from collections.abc import Iterator, Set
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ds_zero._params.partitioned_param import ZeroParamState

__all__ = ["ActiveConsumers"]


class ActiveConsumers(Set[str]):
    """The claims on one partitioned parameter's full values, named (`param.ds_active_sub_modules`).

    Its size is the number of claims; iterating yields one description per claim: the module whose
    forward or backward holds it (`"module 'layers.0' (forward)"`), or the kind of claim when no module
    made it (a `GatheredParameters` block, a hold to the end of the iteration).
    """

    __slots__ = ("_ds_id", "_state")

    def __init__(self, ds_id: int, state: ZeroParamState) -> None:
        self._ds_id = ds_id  # not the parameter itself: the parameter holds this view, no reference cycle
        self._state = state

    def _names(self) -> list[str]:
        st = self._state
        named = list(st.coord.consumers_of(self._ds_id)) if st.coord is not None else []
        named = named[: st.active]
        return named + ["GatheredParameters block or on-demand read"] * (st.active - len(named))

    def __len__(self) -> int:
        return self._state.active

    def __iter__(self) -> Iterator[str]:
        # duplicates (two claims of the same kind) are suffixed so the set semantics hold
        seen: dict[str, int] = {}
        for name in self._names():
            seen[name] = seen.get(name, 0) + 1
            yield name if seen[name] == 1 else f"{name} #{seen[name]}"

    def __contains__(self, item: object) -> bool:
        return any(item == name for name in self)

    def __repr__(self) -> str:
        return f"ActiveConsumers({sorted(self)!r})"
