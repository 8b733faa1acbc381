"""egressbox's own caches (the host probe, the compiled seccomp program), trusted only if ours.

A cache steers the next run's confinement, so a forged one would weaken it (an allow-all
filter, a host "without namespaces"). The child never gets to write one: the cache directory
is read-only or absent in every child's view. And before a run believes a cached file, it
checks that the file and its directory belong to the invoking user, are written by nobody
else, and are not symlinks; anything else is ignored and rebuilt.
"""

from __future__ import annotations

import contextlib
import os
import stat

# Names carry a format version: files written before the checks existed are never read.
VERSION = "v2"
MAX_BYTES = 1 << 20
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


def directory() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "egressbox")


def path(name: str) -> str:
    return os.path.join(directory(), f"{VERSION}-{name}")


def _ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & _UNSAFE_BITS


def read(file: str) -> bytes | None:
    """The file's bytes if it and its directory are ours alone, else None."""
    try:
        folder = os.lstat(os.path.dirname(file))
        if not stat.S_ISDIR(folder.st_mode) or not _ours(folder):
            return None
        fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or not _ours(st) or st.st_size > MAX_BYTES:
            return None
        return os.read(fd, MAX_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)


def write(file: str, data: bytes) -> None:
    """Atomically, mode 0600 in a 0700 directory of ours; failures are silent (a cache)."""
    folder = os.path.dirname(file)
    with contextlib.suppress(OSError):
        os.makedirs(folder, mode=0o700, exist_ok=True)
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or not _ours(st):
            return
        tmp = f"{file}.{os.getpid()}"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        os.replace(tmp, file)
