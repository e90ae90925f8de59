"""The persistent compilation cache a server keeps its compiled steps in (JAX's cache and
our executable store inside it, :mod:`jax_kvcached.engine.executables`).

A folder that cannot be written (read-only, a full disk) never stops a server: it is said
once at WARNING and serving goes on, loading what the folder holds and compiling the rest.
What the folder holds runs as code (compiled executables, the store's entries), so a
folder owned by another user, or one others may write, is not used at all: said once,
every step compiles. A new folder is made private (0700).
JAX warns once per cache entry it fails to write or read (a truncated file); those warnings
become one line each.
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings

from jax_kvcached.engine.executables import untrusted

log = logging.getLogger("jax_kvcached.serve")

COMPILE_CACHE_ENV = "KVCACHED_COMPILE_CACHE"
_PROBE_BYTES = 64 << 10  # a write this size must succeed for the folder to count as writable
_JAX_WRITE_ERROR = "Error writing persistent compilation cache entry"
_JAX_READ_ERROR = "Error reading persistent compilation cache entry"


def default_compile_cache() -> str:
    """``$KVCACHED_COMPILE_CACHE``, else ``~/.cache/jax-kvcached/xla``."""
    from jax_kvcached.models.download import user_cache_dir

    return user_cache_dir("xla", COMPILE_CACHE_ENV)


def _write_probe(path: str) -> None:
    fd, tmp = tempfile.mkstemp(dir=path, suffix=".probe")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(b"\0" * _PROBE_BYTES)
    finally:
        os.unlink(tmp)


class _CacheErrorsOnce:
    """Replaces ``warnings.showwarning``: JAX's cache-write and cache-read warnings (one
    per entry) are each said once, as a log line naming the folder; other warnings pass
    through."""

    def __init__(self, path: str, said_write: bool) -> None:
        self.path, self.show = path, warnings.showwarning
        self.said = {_JAX_WRITE_ERROR: said_write, _JAX_READ_ERROR: False}

    def __call__(self, message, category, filename, lineno, file=None, line=None) -> None:
        kind = next((k for k in self.said if str(message).startswith(k)), None)
        if kind is None:
            self.show(message, category, filename, lineno, file, line)
            return
        if self.said[kind]:
            return
        self.said[kind] = True
        if kind == _JAX_WRITE_ERROR:
            log.warning("the compilation cache %s cannot be written (%s): compiled steps are "
                        "not kept for the next start", self.path, message)  # fmt: skip
        else:
            log.warning("the compilation cache %s holds entries that do not load (%s): they "
                        "compile again (said once)", self.path, message)  # fmt: skip


def enable_compile_cache(path: str | None) -> str | None:
    """Turns on JAX's persistent compilation cache in ``path`` (None: the default; "off"
    or "": disabled), so a second start loads its compiled steps instead of compiling
    them; returns the directory used (None: off, or a folder that could not be made)."""
    import jax

    path = default_compile_cache() if path is None else path
    if path in ("", "off", "none"):
        return None
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except OSError as e:
        log.warning("no compilation cache: %s cannot be made (%s: %s); every start compiles",
                    path, type(e).__name__, e)  # fmt: skip
        return None
    why = untrusted(path)
    if why:
        log.warning("no compilation cache: %s %s, and what it holds would run as code; "
                    "every start compiles (use a folder of your own, mode 700)", path,
                    why)  # fmt: skip
        return None
    said = False
    try:
        _write_probe(path)
    except OSError as e:
        said = True
        log.warning("the compilation cache %s cannot be written (%s: %s): what it holds "
                    "loads, new compiled steps are not kept", path, type(e).__name__,
                    e)  # fmt: skip
    if not isinstance(warnings.showwarning, _CacheErrorsOnce):
        warnings.showwarning = _CacheErrorsOnce(path, said)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return path
