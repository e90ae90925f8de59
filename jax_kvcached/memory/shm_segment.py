"""The shared-memory segment of a process group: its layout, its lock, who is alive.

A POSIX shared-memory object (``/dev/shm/jax_kvcached.<group>``: what ``shm_open`` creates
on Linux) holds a fixed header and a table of tenant rows:

- header: magic, layout version, page size, the group's budget in pages, table size.
- row: a name and int64 fields (:data:`FIELDS`): the owner's pid and start time, the
  tenant's mapped and reserved pages, limit, guarantee, the pages others ask it to give
  back, prefix-cache counters, a status word its owner publishes and a request word
  other processes post (opaque to the memory layer: serve/ gives them their meaning).

The lock is ``flock`` on the segment's file: the kernel drops it when its holder dies, even
by ``kill -9``, so a dead process never deadlocks the group. Every write is one aligned
int64 store, a row is published by its ``state`` field last, and the group's totals are
always summed from the rows (never stored), so a process killed mid-update leaves no
half-made total behind. A row whose process is gone (pid absent, a zombie, or reused by
a process with another start time) is swept.

This module knows nothing of tenants' semantics: :mod:`shared_ledger` does.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import stat
import threading
import time
from collections.abc import Iterator

import numpy as np

from jax_kvcached.memory.errors import KVCacheError

MAGIC = b"JAXKVGRP"
VERSION = 2
MAX_TENANTS = 64
NAME_BYTES = 64
SHM_DIR = "/dev/shm"
PREFIX = "jax_kvcached."

# The int64 fields of a row, in order.
FIELDS = (
    "state",  # 0 free, 1 in use (written last when a row is published)
    "pid",
    "start_time",  # the owner's start time (clock ticks since boot): guards pid reuse
    "member",  # the owner's ledger (a process may hold several pools of one group)
    "pages_per_kv_page",
    "mapped_pages",
    "reserved_pages",  # the owner pool's created-but-unmapped pages (its reserve)
    "limit_pages",  # -1: no limit (the budget)
    "guarantee_pages",
    "request_pages",  # pages other tenants ask this one to give back (0: none)
    "given_pages",  # pages given back on request (counter)
    "hit_tokens",  # prefix-cache tokens found / looked up (counters)
    "query_tokens",
    "idle_pages",  # pages its engine could give back now (idle cached prefixes); -1 unknown
    "updated_ns",  # when the owner last published (time.time_ns)
    "status",  # what its owner publishes (opaque here; serve/: its sleep level)
    "request",  # what another process asks of it until the owner clears it (opaque here)
)
F = {name: i for i, name in enumerate(FIELDS)}

HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<i8"),
        ("page_size", "<i8"),
        ("budget_pages", "<i8"),
        ("max_tenants", "<i8"),
        ("created_ns", "<i8"),
        ("initialized", "<i8"),
        ("pad", "<i8"),
    ]
)
ROW = np.dtype([("name", f"S{NAME_BYTES}"), ("f", "<i8", (len(FIELDS),)), ("pad", "<i8", (1,))])
SIZE = HEADER.itemsize + MAX_TENANTS * ROW.itemsize

_GROUP_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class GroupMismatch(KVCacheError, ValueError):
    """The segment is not one this version can use (foreign, stale or another layout)."""


def check_group(group: str) -> str:
    if not isinstance(group, str) or not _GROUP_RE.match(group):
        raise ValueError(f"a group name is 1-64 letters, digits, '_', '.' or '-', got {group!r}")
    return group


def segment_path(group: str) -> str:
    return os.path.join(SHM_DIR, PREFIX + check_group(group))


def groups() -> list[str]:
    """Groups with a segment on this machine."""
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return []
    return sorted(n[len(PREFIX) :] for n in names if n.startswith(PREFIX))


def remove(group: str) -> bool:
    """Removes a group's segment (processes that have it open keep their copy); False
    if there was none."""
    try:
        os.unlink(segment_path(group))
    except FileNotFoundError:
        return False
    return True


def remove_if_unused(group: str) -> int:
    """Removes a group's segment when no live process has a tenant in it (rows of dead
    processes are swept first, under the group's lock); returns the live tenants (0:
    removed). A process that attaches later creates a new segment. KeyError: no group."""
    seg = Segment(group)
    try:
        with seg.locked():
            seg.sweep()
            live = len(seg.used_rows())
            if live == 0:
                remove(group)
            return live
    finally:
        seg.close()


def start_time(pid: int) -> int | None:
    """A process's start time (clock ticks after boot); None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rest = stat[stat.rfind(b")") + 2 :].split()  # fields 3.. (the name may hold spaces)
    if rest[0] in (b"Z", b"X"):
        return None
    return int(rest[19])


def alive(pid: int, started: int) -> bool:
    return pid > 0 and start_time(pid) == started


class Segment:
    """One process's handle on a group's segment.

    ``create=True`` makes the segment if it does not exist (with ``page_size`` and
    ``budget_pages``); otherwise it must exist. A segment that exists is validated: magic,
    version, size and page size; GroupMismatch otherwise (nothing is changed).
    """

    def __init__(
        self,
        group: str,
        *,
        create: bool = False,
        page_size: int | None = None,
        budget_pages: int | None = None,
    ) -> None:
        self.group = check_group(group)
        self.path = segment_path(group)
        self._tlock = threading.RLock()  # flock excludes processes; this, threads
        self._depth = 0
        for _ in range(100):  # a segment unlinked while we opened it: open the new one
            fd = self._open(create)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = self._same_file(fd)
                if same:
                    self._init_or_check(fd, create, page_size, budget_pages)
            except BaseException:
                os.close(fd)  # drops the lock too
                raise
            fcntl.flock(fd, fcntl.LOCK_UN)
            if same:
                break
            os.close(fd)  # a stale file: neither its lock nor its descriptor is kept
        else:
            raise KVCacheError(f"group {group!r}: its segment keeps being replaced")
        self._fd = fd
        self._mm = mmap.mmap(fd, SIZE)
        self.header = np.ndarray((), HEADER, self._mm, 0)
        self.rows = np.ndarray((MAX_TENANTS,), ROW, self._mm, HEADER.itemsize)
        self.f = self.rows["f"]  # (MAX_TENANTS, len(FIELDS)) int64, a view
        self.page_size = int(self.header["page_size"])
        self.closed = False

    def _open(self, create: bool) -> int:
        """The segment's descriptor: never through a symlink, and only a file of this
        user that no one else may read or write (another user who made the name first
        would otherwise see every tenant and steer the group). KVCacheError naming it."""
        flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
        try:
            fd = os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            raise KeyError(f"no group {self.group!r} on this machine ({self.path})") from None
        except OSError as e:  # (ELOOP: a symlink)
            raise KVCacheError(f"group {self.group!r}: cannot open {self.path}: "
                               f"{e.strerror}") from None  # fmt: skip
        st = os.fstat(fd)
        why = (f"belongs to another user (uid {st.st_uid})" if st.st_uid != os.getuid()
               else f"has mode {stat.S_IMODE(st.st_mode):o}, not 600"
               if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO) else
               "is not a regular file" if not stat.S_ISREG(st.st_mode) else None)  # fmt: skip
        if why:
            os.close(fd)
            raise KVCacheError(f"group {self.group!r}: the segment {self.path} {why}; it is "
                               "not joined (remove it, or use another group name)")  # fmt: skip
        return fd

    def _same_file(self, fd: int) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def _init_or_check(
        self, fd: int, create: bool, page_size: int | None, budget_pages: int | None
    ) -> None:
        size = os.fstat(fd).st_size
        if size == 0 and create:  # new (or its creator died before writing anything)
            if page_size is None or budget_pages is None:
                raise ValueError("creating a group needs its page size and budget")
            os.ftruncate(fd, SIZE)
            head = np.zeros((), HEADER)
            head["magic"], head["version"] = MAGIC, VERSION
            head["page_size"], head["budget_pages"] = page_size, budget_pages
            head["max_tenants"], head["created_ns"] = MAX_TENANTS, time.time_ns()
            head["initialized"] = 1
            os.pwrite(fd, head.tobytes(), 0)
            return
        head_bytes = os.pread(fd, HEADER.itemsize, 0)
        where = f"shared-memory segment {self.path}"
        fix = f"; if no process uses it, remove it (rm {self.path}) and start again"
        if len(head_bytes) < HEADER.itemsize:
            raise GroupMismatch(f"{where} is not a jax-kvcached group (too small){fix}")
        head = np.frombuffer(head_bytes, HEADER)[0]
        if head["magic"] != MAGIC:
            raise GroupMismatch(f"{where} is not a jax-kvcached group (foreign data){fix}")
        if head["version"] != VERSION or head["max_tenants"] != MAX_TENANTS or size != SIZE:
            raise GroupMismatch(
                f"{where} has layout version {int(head['version'])} ({size} bytes); this "
                f"jax-kvcached uses version {VERSION} ({SIZE} bytes): a stale segment or "
                f"another version's{fix}"
            )
        if not head["initialized"]:
            raise GroupMismatch(f"{where} was never initialized{fix}")
        if page_size is not None and head["page_size"] != page_size:
            raise GroupMismatch(
                f"group {self.group!r} uses {int(head['page_size'])}-byte pages, this pool "
                f"{page_size}: every process of a group needs the same page size"
            )

    # -- the lock ----------------------------------------------------------------------
    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Holds the group's lock (re-entrant within this process)."""
        with self._tlock:
            if self.closed:
                raise KVCacheError(f"group {self.group!r}: the segment is closed")
            if self._depth == 0:
                fcntl.flock(self._fd, fcntl.LOCK_EX)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)

    # -- rows ------------------------------------------------------------------------------
    @property
    def budget_pages(self) -> int:
        return int(self.header["budget_pages"])

    def used_rows(self) -> list[int]:
        return [int(i) for i in np.flatnonzero(self.f[:, F["state"]] == 1)]

    def name_of(self, row: int) -> str:
        return bytes(self.rows["name"][row]).decode()

    def find(self, name: str) -> int | None:
        """The row of tenant ``name`` (None: not in the group)."""
        key = name.encode()
        for i in self.used_rows():
            if self.rows["name"][i] == key:
                return i
        return None

    def get(self, row: int, field: str) -> int:
        return int(self.f[row, F[field]])

    def set(self, row: int, field: str, value: int) -> None:
        self.f[row, F[field]] = value

    def add_row(self, name: str, fields: dict[str, int]) -> int:
        """Publishes a new row (under the lock): fields first, ``state`` last."""
        key = name.encode()
        if len(key) > NAME_BYTES:
            raise ValueError(f"a tenant name in a group is at most {NAME_BYTES} bytes: {name!r}")
        free = np.flatnonzero(self.f[:, F["state"]] == 0)
        if free.size == 0:
            raise KVCacheError(f"group {self.group!r} has {MAX_TENANTS} tenants: no room")
        i = int(free[0])
        self.f[i] = 0
        self.rows["name"][i] = key
        for k, v in fields.items():
            self.set(i, k, v)
        self.set(i, "state", 1)
        return i

    def drop_row(self, row: int) -> None:
        self.set(row, "state", 0)

    def sweep(self) -> list[str]:
        """Frees the rows of processes that are gone (under the lock); returns their
        names."""
        gone = []
        for i in self.used_rows():
            if not alive(self.get(i, "pid"), self.get(i, "start_time")):
                gone.append(self.name_of(i))
                self.drop_row(i)
        return gone

    def close(self) -> None:
        with self._tlock:
            if self.closed:
                return
            self.closed = True
            del self.f, self.rows, self.header
            self._mm.close()
            os.close(self._fd)
