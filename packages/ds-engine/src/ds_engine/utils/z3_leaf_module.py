"""`deepspeed.utils.z3_leaf_module`: ZeRO-3 leaf modules (`set_z3_leaf_modules` and friends), ds-zero's.

A leaf module's whole subtree is gathered when it is entered, so ranks whose control flow differs inside
it (mixture-of-experts routing) do not issue different gathers; see `ds_zero.set_z3_leaf_modules`.
Needs the `zero` extra: without ds-zero, importing this module raises ImportError naming
`pip install 'ds-engine[zero]'`.

In DeepSpeed, `deepspeed.utils.z3_leaf_module` is the *function* (`deepspeed/utils/__init__.py` rebinds the
name after importing the submodule), while `import deepspeed.utils.z3_leaf_module` gives this module. Here
the name is the module either way, and the module is callable as the function (`z3_leaf_module(module)`
is `z3_leaf_module.z3_leaf_module(module)`), so both spellings work whatever was imported first.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING

from ds_engine._reexport import optional_reexport

if TYPE_CHECKING:  # names are looked up at run time; type checkers see ds_zero's own
    from ds_zero import *  # noqa: F403

NAMES = (
    "get_z3_leaf_modules",
    "set_z3_leaf_module",
    "set_z3_leaf_modules",
    "set_z3_leaf_modules_by_name",
    "set_z3_leaf_modules_by_suffix",
    "unset_z3_leaf_modules",
    "z3_leaf_module",
    "z3_leaf_parameter",
)

__all__, __getattr__, __dir__ = optional_reexport(
    "ds_engine.utils.z3_leaf_module",
    "ds_zero",
    extra="zero",
    feature="ds_engine.utils.z3_leaf_module (deepspeed.utils.z3_leaf_module, ZeRO-3 leaf modules)",
    names=NAMES,
)


class _CallableModule(types.ModuleType):
    """This module, callable as DeepSpeed's `z3_leaf_module(model)`."""

    def __call__(self, model: object) -> bool:
        return bool(self.z3_leaf_module(model))


sys.modules[__name__].__class__ = _CallableModule
