"""Where JIT-built ops live, how their cache key is made, and the lock that makes ranks build once."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

try:
    import fcntl
except ImportError:  # Windows: no JIT builds there (is_compatible says so); importing must still work
    fcntl = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)


def extensions_root() -> Path:
    """The JIT cache root: `$TORCH_EXTENSIONS_DIR/ds_ops`, else `~/.cache/torch_extensions/ds_ops`.

    Read at call time (never at import), so a test or a launcher can point it elsewhere.
    """
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        base = Path(configured)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torch_extensions"
    return base / "ds_ops"


def torch_version() -> str:
    """torch's version without importing torch when it is not imported yet (the AOT hook has no torch)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    import importlib.metadata  # noqa: PLC0415 - 30 ms to import; only needed when torch is not loaded

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def hash_files(paths: Iterable[Path]) -> str:
    """sha256 over the names and contents of `paths` (the sources and every header they may include)."""
    digest = hashlib.sha256()
    for path in paths:
        digest.update(path.name.encode())
        digest.update(b"\0")
        digest.update(path.read_bytes())
        digest.update(b"\0")
    return digest.hexdigest()


def cache_key(parts: Iterable[str]) -> str:
    """A short stable key over `parts` (op name, torch version, compiler, flags, source hash)."""
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


@contextlib.contextmanager
def file_lock(path: Path, *, what: str) -> Iterator[None]:
    """Hold an exclusive `fcntl.flock` on `path` (created if missing).

    Concurrent ranks on one host take it in turn; the ones that wait log once at INFO. The kernel
    drops the lock if the holder dies, so a killed build never wedges the others.
    """
    if fcntl is None:
        raise OSError(f"cannot lock {path}: fcntl is not available on this platform")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                raise
            logger.info("waiting for another process to finish %s (lock %s)", what, path)
            started = time.perf_counter()
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            logger.debug("waited %.1f s for %s", time.perf_counter() - started, what)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
