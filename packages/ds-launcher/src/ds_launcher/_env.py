"""Which environment variables travel to the workers, and the user's `.deepspeed_env` file.

Remote nodes start from a login shell, not from the environment `deepspeed` ran in, so the runner
forwards what a worker needs: every variable whose name starts with one of `EXPORT_PREFIXES`
(NCCL tuning, PYTHONPATH and friends, MPI/UCX settings, `DS_ACCELERATOR`, `DEEPSPEED_TIMEOUT`),
`PYTHONPATH` with the launch directory in front, and every `KEY=VALUE` line of `.deepspeed_env`.

[Note: values are literal] A value is everything after the first `=`, stripped of surrounding
whitespace, and reaches the worker byte for byte: no quote removal, no `$` expansion. Runners
that go through a remote shell quote it with `shlex.quote` (DeepSpeed wraps such values in double
quotes, which lets the remote shell expand `$x` and backquotes inside them).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

logger = logging.getLogger(__name__)

#: Name prefixes of the variables forwarded to every node (DeepSpeed's list plus NCCL on every accelerator).
EXPORT_PREFIXES = ("NCCL", "PYTHON", "MLFLOW", "MV2", "UCX", "DS_ACCELERATOR", "DEEPSPEED_TIMEOUT")
#: The env file's name, looked up in the home directory and then the launch directory.
DEFAULT_ENV_FILE = ".deepspeed_env"

_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class EnvFileError(ValueError):
    """A `.deepspeed_env` line that is not `KEY=VALUE`; the message names the file and line."""


def parse_env_file(text: str, source: str = DEFAULT_ENV_FILE) -> dict[str, str]:
    """Parse `KEY=VALUE` lines; blank lines and lines starting with `#` are skipped.

    A leading `export ` is allowed (so the file can also be sourced by a shell). Later lines
    override earlier ones.

    Raises:
        EnvFileError: a line without `=`, or a key that is not a valid variable name.
    """
    values: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export ") :].lstrip()
        key, sep, value = line.partition("=")
        key = key.strip()
        if not sep:
            raise EnvFileError(f"{source}:{lineno}: {raw!r} is not KEY=VALUE; write e.g. 'NCCL_DEBUG=INFO'")
        if not _KEY.match(key):
            raise EnvFileError(
                f"{source}:{lineno}: {key!r} is not a valid environment variable name "
                "(letters, digits and '_', not starting with a digit)"
            )
        values[key] = value.strip()
    return values


def env_file_paths(environ: Mapping[str, str], *, cwd: str, home: str) -> list[str]:
    """The env files to read, in override order (later wins).

    `DS_ENV_FILE` names the file. A bare name is looked up in `home` and then `cwd` (both read
    when both exist, as DeepSpeed does); a path is used as is and must exist.

    Raises:
        EnvFileError: `DS_ENV_FILE` is a path that does not exist.
    """
    name = environ.get("DS_ENV_FILE", DEFAULT_ENV_FILE)
    if os.sep in name or (os.altsep and os.altsep in name):
        if not os.path.isfile(name):
            raise EnvFileError(f"DS_ENV_FILE={name!r} does not exist; point it at a KEY=VALUE file or unset it")
        return [name]
    paths: list[str] = []
    for directory in (home, cwd):
        path = os.path.join(directory, name)
        if os.path.isfile(path) and os.path.realpath(path) not in {os.path.realpath(p) for p in paths}:
            paths.append(path)
    return paths


def read_env_files(environ: Mapping[str, str], *, cwd: str, home: str) -> dict[str, str]:
    """The merged contents of the env files `env_file_paths` finds (empty when there are none)."""
    values: dict[str, str] = {}
    for path in env_file_paths(environ, cwd=cwd, home=home):
        with open(path, encoding="utf-8") as f:
            parsed = parse_env_file(f.read(), source=path)
        logger.info("read %d variable(s) from %s", len(parsed), path)
        values.update(parsed)
    return values


def collect_exports(environ: Mapping[str, str], *, cwd: str, home: str) -> dict[str, str]:
    """Everything a worker on another node needs from this environment, in a stable order.

    Order: `PYTHONPATH` (the launch directory first, so the user's modules import), then the
    forwarded variables sorted by name, then the env-file entries in file order (overriding).

    Args:
        environ: the runner's environment (normally `os.environ`).
        cwd: the launch directory.
        home: the user's home directory.
    """
    exports: dict[str, str] = {}
    existing = environ.get("PYTHONPATH", "")
    exports["PYTHONPATH"] = f"{cwd}{os.pathsep}{existing}" if existing else cwd
    for key in sorted(environ):
        if key != "PYTHONPATH" and key.startswith(EXPORT_PREFIXES):
            exports[key] = environ[key]
    exports.update(read_env_files(environ, cwd=cwd, home=home))
    return exports
