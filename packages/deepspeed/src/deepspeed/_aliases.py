"""The alias table and the meta-path finder that makes `import deepspeed.<path>` return the ds module.

[Note: why aliases, not copies or proxies]
`import deepspeed.runtime.zero.partition_parameters as pp` must give the very module object that ds
imports itself (`sys.modules["deepspeed.X"] is sys.modules["ds_engine.X"]`): the frameworks monkeypatch
these modules (transformers swaps `pp.zero_wrapper_for_fp_tensor_constructor` around `from_pretrained`),
compare classes (`isinstance(model, deepspeed.DeepSpeedEngine)`) and pickle objects by `__module__`; a
re-export or proxy module would take the patch and leave ds's code unpatched. So the finder's loader
hands back the already imported ds module and executes nothing; the module keeps its own `__name__`,
`__spec__` and `__file__`.

The table maps DeepSpeed's module prefixes onto the ds packages: everything under `deepspeed.` is
ds-engine's (which lays out DeepSpeed's paths: `ds_engine.runtime.zero.partition_parameters`,
`ds_engine.checkpoint.utils`, `ds_engine.utils.groups`...), except the launcher and the autotuner (ds-launcher), the
accelerator package and `utils.pin_memory` (ds-comm), and DeepNVMe's `io` and `nvme` (ds-ops). Because
the mapping is a prefix rewrite, an aliased package's children are that package's own children, and
the import system's `setattr(parent, child, module)` after an import puts a foreign module on a ds
module only where a child is mapped on its own (`deepspeed.io.constants` is ds-ops' `fast_io.constants`,
one module under both names).

[Note: DeepSpeed paths ds does not implement]
A path that is one of DeepSpeed 0.19.8's own modules (`deepspeed_0_19_8_modules.txt`) but has no ds
module behind it fails with a `ModuleNotFoundError` (an `ImportError`) that says so and points to the
compatibility page, instead of Python's bare "No module named". Any other unknown path stays unknown.
The finder hands out a spec whose loader raises, so `importlib.util.find_spec` on such a path returns a
spec; the frameworks probe only `deepspeed` itself.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Sequence
from functools import cache
from importlib.resources import files
from types import CodeType, ModuleType

__all__ = ["ALIASES", "COMPATIBILITY_PAGE", "AliasFinder", "deepspeed_module_paths", "install", "resolve"]

#: Where a missing DeepSpeed path's error sends the reader: every DeepSpeed 0.19.8 subsystem, module path
#: and config section with its state in ds.
COMPATIBILITY_PAGE = "COMPATIBILITY.md at the root of the ds repository"

#: DeepSpeed module prefix -> the ds module that implements it. The longest matching prefix wins.
ALIASES: dict[str, str] = {
    "deepspeed.launcher": "ds_launcher",
    # The autotuner launches experiments as processes, so it is the launcher's.
    "deepspeed.autotuning": "ds_launcher.autotuning",
    # DeepSpeed's accelerator package (its per-device `*_accelerator` modules) and the pinned-memory
    # backend it dispatches to are ds-comm's, the floor every package pins memory through.
    "deepspeed.accelerator": "ds_comm.accelerator",
    "deepspeed.utils.pin_memory": "ds_comm.native_pinned_memory",
    # DeepNVMe's file writers and benchmark/tuning tools sit on the async I/O op; the engine uses neither.
    "deepspeed.io": "ds_ops.io",
    "deepspeed.io.constants": "ds_ops.fast_io.constants",
    "deepspeed.nvme": "ds_ops.nvme",
    "deepspeed": "ds_engine",
}

_ORDER = sorted(ALIASES, key=len, reverse=True)


def resolve(fullname: str) -> str | None:
    """The ds module name behind DeepSpeed's `fullname` (`"deepspeed.ops.adam"` -> `"ds_engine.ops.adam"`).

    None for names outside `deepspeed.*` and for `deepspeed` itself (this distribution's own package).
    """
    if fullname == "deepspeed":
        return None
    for prefix in _ORDER:
        if fullname == prefix or fullname.startswith(prefix + "."):
            return ALIASES[prefix] + fullname[len(prefix) :]
    return None


@cache
def deepspeed_module_paths() -> frozenset[str]:
    """Every module path of DeepSpeed 0.19.8's wheel (`deepspeed`, `deepspeed.ops.adam`, ...)."""
    text = files(__package__).joinpath("deepspeed_0_19_8_modules.txt").read_text(encoding="utf-8")
    return frozenset(line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#"))


class _MissingLoader(importlib.abc.Loader):
    """Fails the import of a DeepSpeed 0.19.8 module that ds does not implement, naming it."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        raise ModuleNotFoundError(
            f"{spec.name} is a DeepSpeed 0.19.8 module that ds does not implement; {COMPATIBILITY_PAGE} "
            "lists every DeepSpeed subsystem, module path and config section with its state in ds",
            name=spec.name,
        )

    def exec_module(self, module: ModuleType) -> None:  # pragma: no cover - create_module always raises
        raise AssertionError("unreachable")


class _AliasLoader(importlib.abc.Loader):
    """Returns the ds module itself; executes nothing (it was imported under its own name)."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._original_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._original_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system has just set `module.__spec__` to the alias spec; the module stays ds's own.
        module.__spec__ = self._original_spec

    # `python -m deepspeed.launcher.runner` (runpy) runs the target's code under `__main__`.
    def get_code(self, fullname: str) -> CodeType | None:
        spec = importlib.util.find_spec(self.target)
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "get_code"):
            raise ImportError(f"{fullname} ({self.target}) has no code to run", name=fullname)
        return loader.get_code(self.target)

    def is_package(self, fullname: str) -> bool:
        spec = importlib.util.find_spec(self.target)
        return spec is not None and spec.submodule_search_locations is not None


class AliasFinder(importlib.abc.MetaPathFinder):
    """Finds `deepspeed.<path>` by finding the ds module `resolve()` names; unknown paths stay unknown."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        ds_name = resolve(fullname)
        if ds_name is None:
            return None
        try:
            ds_spec = importlib.util.find_spec(ds_name)
        except ModuleNotFoundError:  # a parent of ds_name is missing: `deepspeed.<path>` does not exist either
            ds_spec = None
        if ds_spec is None:
            if fullname in deepspeed_module_paths():
                return importlib.machinery.ModuleSpec(fullname, _MissingLoader())
            return None
        return importlib.machinery.ModuleSpec(
            fullname, _AliasLoader(ds_name), is_package=ds_spec.submodule_search_locations is not None
        )


def install() -> AliasFinder:
    """Put the finder first on `sys.meta_path` (once); returns the installed finder."""
    for finder in sys.meta_path:
        if isinstance(finder, AliasFinder):
            return finder
    finder = AliasFinder()
    sys.meta_path.insert(0, finder)
    return finder
