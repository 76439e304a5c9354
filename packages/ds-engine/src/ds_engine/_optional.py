"""`require`: the one door to optional siblings (ds-zero, ds-pipe), opened only inside functions."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["require"]


def require(module: str, *, extra: str, feature: str) -> ModuleType:
    """Import an optional sibling, or explain which extra installs it.

    Args:
        module: import name, e.g. `"ds_zero"`.
        extra: the ds-engine extra that pulls it in (`"zero"`, `"pipe"`).
        feature: what the caller asked for, for the message (`"ZeRO stage 2"`).

    Raises:
        ImportError: the sibling is not installed; the message names the pip command.
        ModuleNotFoundError: something the sibling itself imports is missing (a real bug, not masked).
    """
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        raise ImportError(f"{feature} needs {module.replace('_', '-')}: pip install 'ds-engine[{extra}]'") from None
