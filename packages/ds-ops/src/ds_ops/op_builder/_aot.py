"""Which ops an install compiles ahead of time: DeepSpeed's DS_BUILD_OPS / DS_BUILD_<OP> variables.

`DS_BUILD_OPS=1` selects every op (an op this host cannot build is skipped with a warning);
`DS_BUILD_<OP>=1` selects one op and makes a failure to build it an error; `DS_BUILD_<OP>=0`
removes an op from `DS_BUILD_OPS=1`. Used by the wheel's build hook (hatch_build.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

_TRUE = {"1", "true", "yes", "on"}
# DeepSpeed's variables that are not DS_BUILD_<NAME>: async_io is built with DS_BUILD_AIO.
_BUILD_VARS = {"async_io": "DS_BUILD_AIO"}
_FALSE = {"0", "false", "no", "off", ""}


def env_var(op_name: str) -> str:
    """`cpu_adam` -> `DS_BUILD_CPU_ADAM` (and DeepSpeed's exception: `async_io` -> `DS_BUILD_AIO`)."""
    return _BUILD_VARS.get(op_name, f"DS_BUILD_{op_name.upper()}")


def _flag(environ: Mapping[str, str], name: str) -> bool | None:
    if name not in environ:
        return None
    value = environ[name].strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{name}={environ[name]!r} is not a boolean; use {name}=1 or {name}=0")


def selected_ops(environ: Mapping[str, str], op_names: Iterable[str]) -> dict[str, bool]:
    """The ops to prebuild, each mapped to whether it was asked for by name (then a failure is an error).

    Raises:
        ValueError: a DS_BUILD_* variable is not a boolean, or names an op that does not exist.
    """
    names = list(op_names)
    known = {env_var(name) for name in names} | {"DS_BUILD_OPS"}
    unknown = sorted(
        key for key in environ if key.startswith("DS_BUILD_") and key not in known and key not in ("DS_BUILD_STRING",)
    )
    if unknown:
        raise ValueError(
            f"unknown op variable(s) {', '.join(unknown)}; ops are: {', '.join(env_var(n) for n in names)}"
        )
    build_all = bool(_flag(environ, "DS_BUILD_OPS"))
    selected: dict[str, bool] = {}
    for name in names:
        flag = _flag(environ, env_var(name))
        if flag is True:
            selected[name] = True
        elif flag is None and build_all:
            selected[name] = False
    return selected
