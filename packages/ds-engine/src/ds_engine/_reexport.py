"""DeepSpeed's import paths over ds's code: `optional_reexport` (an optional sibling) and `alias_module` (a layer).

A shim module such as `ds_engine/pipe.py` is one line:

    __all__, __getattr__, __dir__ = optional_reexport("ds_engine.pipe", "ds_pipe", extra="pipe", feature=...)

Importing the shim imports the sibling (through `require`, so a missing one is an ImportError that
names `pip install 'ds-engine[<extra>]'`); names are then looked up on the sibling at each access
(PEP 562 module `__getattr__`), so `from ds_engine.pipe import PipelineModule` returns ds-pipe's own
class, never a copy. `import ds_engine` itself imports no shim: `ds_engine.__getattr__` does on first use.

A DeepSpeed path whose code is ds-engine's own (`ds_engine/utils/groups.py` over `_parallel/groups.py`)
calls `alias_module(__name__, target)` and is then that very module.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ds_engine._optional import require

__all__ = ["alias_module", "optional_reexport"]


def optional_reexport(
    shim: str,
    target: str,
    *,
    extra: str,
    feature: str,
    names: Sequence[str] | None = None,
    renames: Mapping[str, str] | None = None,
) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """`(__all__, __getattr__, __dir__)` for a shim module that re-exports `target` (a sibling or its submodule).

    Args:
        shim: the shim's own name, for error messages (`"ds_engine.pipe"`).
        target: what it re-exports: `"ds_pipe"`, or a submodule such as `"ds_pipe.checkpointing"`.
        extra: the ds-engine extra that installs the sibling (`"pipe"`, `"zero"`).
        feature: what the user asked for, for the missing-extra message.
        names: re-export only these names of `target` (None: its whole public API).
        renames: DeepSpeed's name -> the name `target` gives the same object (DeepSpeed's `GroupedExperts` is
            ds's `SizedGroupedExperts`); the DeepSpeed names are added to the shim's names.

    Raises:
        ImportError: the sibling is not installed (names the pip command).
    """
    sibling = target.split(".", 1)[0]

    def load() -> Any:
        require(sibling, extra=extra, feature=feature)
        return importlib.import_module(target)

    module = load()
    public = [name for name in getattr(module, "__all__", dir(module)) if not name.startswith("_")]
    renames = dict(renames or {})
    if names is not None:
        public = list(names)
    public += [name for name in renames if name not in public]
    allowed = None if names is None else set(public)

    def __getattr__(name: str) -> Any:  # noqa: N807 - the PEP 562 hook
        if name.startswith("__") or (allowed is not None and name not in allowed):
            # __path__, __spec__...: this shim is a plain module, not `target`
            raise AttributeError(f"module {shim!r} has no attribute {name!r}")
        try:
            return getattr(load(), renames.get(name, name))
        except AttributeError:
            raise AttributeError(f"module {shim!r} has no attribute {name!r} ({target} does not provide it)") from None

    def __dir__() -> list[str]:  # noqa: N807 - the PEP 562 hook
        return sorted(public)

    return public, __getattr__, __dir__


def alias_module(shim: str, target: str) -> None:
    """Make DeepSpeed's path `shim` the very module object `target` (called from the shim's own body).

    [Note: why DeepSpeed's paths alias ds's modules] ds's own code lives in its layers (`_report/`,
    `_checkpoint/`, ...) and never imports a DeepSpeed path; DeepSpeed's scripts and tests import the
    DeepSpeed path, read and reset its module globals (`groups._DATA_PARALLEL_GROUP = None`) and patch its
    functions. Putting `target` into `sys.modules` under the shim's name while the shim is being imported
    makes the import system hand back `target` (it re-reads `sys.modules` when the body finishes), so both
    names are one module: a patch through either is seen by ds's code.
    """
    sys.modules[shim] = importlib.import_module(target)
