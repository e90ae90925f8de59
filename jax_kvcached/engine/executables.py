"""Compiled step programs kept on disk, so a warm start neither traces, lowers nor
compiles: each program is a serialized XLA executable (``jax.experimental.
serialize_executable``) under ``<jax_compilation_cache_dir>/kvcached-executables``.

A program's file name is a hash of everything its executable depends on: this package's
code and its native library (their bytes), JAX's version, the devices, ``XLA_FLAGS``, the
function, its static key and its arguments' shapes, dtypes and shardings, plus what the
caller adds (the model's graph, the cache's layout and handle, the runner's settings).
Any change is another file; a file that fails to load is dropped and compiled again; the
least recently used files go when the store outgrows ``MAX_BYTES`` (2 GiB). A folder that
cannot be written (read-only, a full disk) is said once at WARNING and the store stops
writing; serving goes on, compiling what it does not hold. Only
executables XLA compiled in this process are stored: one JAX's persistent cache loaded
serializes without its CPU kernels (a later load of it fails when it runs: "Function ...
not found"), so the runner leaves those out.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import re
import stat
import tempfile
from typing import Any

import jax
import jaxlib

log = logging.getLogger(__name__)

SUBDIR = "kvcached-executables"
MAX_BYTES = 2 << 30  # the store's cap on disk: the least recently used files go first
_SAID: set[tuple[str, str]] = set()  # (folder, what) said at WARNING in this process


@functools.cache
def code_fingerprint() -> str:
    """A hash of the bytes of this package's Python sources (the models included) and
    of its native extension: a code change never reuses an old executable."""
    import jax_kvcached
    import jax_kvcached.models as models
    from jax_kvcached.memory import _C

    h = hashlib.sha256()
    roots = {os.path.dirname(jax_kvcached.__file__), os.path.dirname(models.__file__)}
    files = sorted(
        os.path.join(d, f)
        for root in roots
        for d, _, names in os.walk(root)
        for f in names
        if f.endswith(".py")
    )
    for path in [*files, _C.__file__]:
        h.update(path.encode())
        with open(path, "rb") as f:
            h.update(f.read())
    return h.hexdigest()


def default_dir() -> str | None:
    """The store's folder inside JAX's persistent compilation cache (None: that cache is
    off, and so is this store)."""
    base = jax.config.jax_compilation_cache_dir
    return os.path.join(base, SUBDIR) if base else None


def untrusted(path: str) -> str | None:
    """Why the folder at ``path`` may hold another user's code (None: it may not): it
    belongs to another user, or others may write it. What such a folder holds is never
    loaded (a stored executable, unpickled and run, is code)."""
    st = os.stat(path)
    if st.st_uid != os.getuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def stable_repr(x: Any) -> str:
    """``repr(x)`` without the memory addresses of functions and objects (the same in
    every process)."""
    return re.sub(r" at 0x[0-9a-fA-F]+", "", repr(x))


def _describe(x: Any) -> str:
    sharding = getattr(x, "sharding", None)
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"{tuple(x.shape)}:{x.dtype}:{sharding}"
    return stable_repr(x)


class ExecutableStore:
    """Serialized executables in ``folder``: :meth:`load` one by its inputs, or
    :meth:`save` one compiled now."""

    def __init__(self, folder: str, max_bytes: int = MAX_BYTES) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self.loaded = 0
        self.saved = 0
        self.dropped = 0  # stored files that did not load (truncated, another jaxlib...)
        self.writable = True  # False after a write failed: nothing more is tried
        self.trusted = True
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
        except OSError as e:  # a read-only or full disk: serve on, compiling each start
            self._stop_writing(e)
        why = next((w for d in (os.path.dirname(folder), folder) if os.path.isdir(d)
                    and (w := untrusted(d))), None)  # fmt: skip
        if why:
            self.trusted = self.writable = False
            self._say_once("untrusted", "the executable store %s is not used: its folder %s; "
                           "every program compiles", folder, why)  # fmt: skip
            return
        self.prune()

    def _say_once(self, what: str, msg: str, *args: Any) -> None:
        """Logs ``msg`` at WARNING the first time ``what`` happens to this folder in this
        process (several models share one), at DEBUG after."""
        level = logging.DEBUG if (self.folder, what) in _SAID else logging.WARNING
        _SAID.add((self.folder, what))
        log.log(level, msg, *args)

    def _stop_writing(self, e: OSError) -> None:
        self.writable = False
        self._say_once("write", "the executable store %s cannot be written (%s: %s): "
                       "compiled steps are not kept; what it holds still loads", self.folder,
                       type(e).__name__, e)  # fmt: skip

    def prune(self) -> int:
        """Removes the least recently used files (by modification time: a load touches
        its file) until the store fits ``max_bytes``; returns how many went. Keys of old
        code, flags or models are never used again, so without this the store grows."""
        entries = []
        try:
            names = os.listdir(self.folder)
        except OSError:
            return 0
        for name in names:
            path = os.path.join(self.folder, name)
            try:
                st = os.stat(path)
            except OSError:
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total = sum(size for _, size, _ in entries)
        removed = 0
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            try:
                os.unlink(path)
            except OSError:
                continue
            total -= size
            removed += 1
        return removed

    @staticmethod
    def key(name: str, static: Any, args: tuple, extra: str) -> str:
        """The file name of a program: ``name`` (the function), ``static`` (its static
        key), ``args`` (shapes, dtypes and shardings) and ``extra`` (the caller's)."""
        h = hashlib.sha256()
        for part in (
            code_fingerprint(), jax.__version__, jaxlib.__version__,
            repr([(d.platform, d.device_kind, d.id) for d in jax.devices()]),
            os.environ.get("XLA_FLAGS", ""), str(jax.config.jax_enable_x64), name, repr(static),
            repr([_describe(x) for x in jax.tree.leaves(args)]), extra,
        ):  # fmt: skip
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:40]

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, key + ".xla")

    def load(self, key: str, devices: list) -> Any | None:
        """The executable stored under ``key``, loaded on ``devices`` (those it was
        compiled for; None: none stored, or one that does not load: then it is
        removed)."""
        from jax.experimental import serialize_executable

        if not self.trusted:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                payload, in_tree, out_tree = pickle.load(f)
            compiled = serialize_executable.deserialize_and_load(
                payload, in_tree, out_tree, backend=devices[0].client, execution_devices=devices
            )
        except FileNotFoundError:
            return None
        except Exception as e:  # truncated, from another jaxlib...: compile it again
            self.dropped += 1
            self._say_once("drop", "dropping the stored executable %s (it compiles again; "
                           "later ones that fail to load are dropped quietly, counted in "
                           "`dropped`): %s: %s", path, type(e).__name__, e)  # fmt: skip
            try:
                os.unlink(path)
            except OSError:
                pass
            return None
        try:
            os.utime(path)  # recently used: pruned last
        except OSError:
            pass
        self.loaded += 1
        return compiled

    def save(self, key: str, compiled: Any) -> None:
        """Stores ``compiled`` under ``key`` (atomically: a reader never sees half a
        file). An executable that cannot be serialized is not stored."""
        from jax.experimental import serialize_executable

        if not self.writable:
            return
        try:
            payload = pickle.dumps(serialize_executable.serialize(compiled))
        except Exception as e:  # (said once: every step shape would say it)
            self._say_once("serialize", "not storing executables in %s: one cannot be "
                           "serialized (%s: %s); they compile at each start", self.folder,
                           type(e).__name__, e)  # fmt: skip
            return
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, self._path(key))
        except OSError as e:  # full disk, read-only folder: stop trying, say it once
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
            self._stop_writing(e)
            return
        self.saved += 1
