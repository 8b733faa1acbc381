"""egressbox's own state (the host probe, the compiled seccomp program, trusted policies),
trusted by *where* it is.

The run side keeps it (runner/facts.py, project.py, layers.py, verify.py); confinement reads
none of it: its plans only must never grant it (runner/assemble.py _refuse_own_state).

A cache steers the next run's confinement, so a forged one would weaken it (an allow-all
filter, a host "without namespaces"). A confined child runs as the invoker's uid, so who
owns a file proves nothing about who wrote it. What protects the state is its place:

- It lives in a directory of its own, outside every home-directory tool cache: root's in
  /var/lib/egressbox, another user's under $XDG_STATE_HOME (~/.local/state/egressbox), or
  where EGRESSBOX_STATE_DIR says.
- No plan may grant it: a run whose writable paths include it is refused before anything
  starts (runner/assemble.py), so in a confined child's view it is absent or read-only.
- It is opened by descriptor, with no symbolic link on the way (egressbox.fs.held), and a file is
  believed only if it and the directory belong to the invoking user and nobody else may
  write them (a second wall against other users, e.g. a shared EGRESSBOX_STATE_DIR).

What this cannot protect: a run without filesystem confinement (the `unrestricted` profile,
or a host with neither Landlock nor mount namespaces) gives the child everything the invoker
may write, egressbox's own installation included. The probe cache has a third wall for that
case: a cached fact can only add a mechanism (runner/facts.py).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping

from egressbox.fs.held import HeldDir

# Names carry a format version: files written before this layout are never read.
VERSION = "v3"
MAX_BYTES = 1 << 20
STATE_ENV = "EGRESSBOX_STATE_DIR"
ROOT_DIRECTORY = "/var/lib/egressbox"
_UNSAFE_BITS = stat.S_IWGRP | stat.S_IWOTH


def directory(env: Mapping[str, str] | None = None) -> str:
    """Where egressbox keeps its state for this user (see the module's doc): the one place
    for the probe cache, the staged workspaces' layers and what a direct run moved aside.
    `env` is the environment to read (this process's by default)."""
    env = os.environ if env is None else env
    given = env.get(STATE_ENV, "")
    if os.path.isabs(given):
        return os.path.normpath(given)
    if os.geteuid() == 0:
        return ROOT_DIRECTORY
    state = env.get("XDG_STATE_HOME", "")
    if not os.path.isabs(state):
        home = env.get("HOME") or os.path.expanduser("~")
        state = os.path.join(home, ".local", "state")
    return os.path.join(state, "egressbox")


def path(name: str) -> str:
    return os.path.join(directory(), f"{VERSION}-{name}")


def _ours(st: os.stat_result) -> bool:
    return st.st_uid == os.geteuid() and not st.st_mode & _UNSAFE_BITS


def _held(folder: str, *, create: bool) -> HeldDir | None:
    """The directory, held, if it is ours alone (made 0700 when `create` and missing)."""
    try:
        held = HeldDir.open(folder, create_mode=0o700 if create else None)
    except OSError:
        return None
    try:
        if _ours(os.fstat(held.fileno())):
            return held
    except OSError:
        pass
    held.close()
    return None


def read(file: str) -> bytes | None:
    """The file's bytes if it and its directory are ours alone, else None."""
    held = _held(os.path.dirname(file), create=False)
    if held is None:
        return None
    with held:
        try:
            fd = held.open_file(os.path.basename(file), os.O_RDONLY | os.O_NONBLOCK)
        except (OSError, ValueError):
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
    held = _held(os.path.dirname(file), create=True)
    if held is None:
        return
    with held, contextlib.suppress(OSError, ValueError):
        held.write_atomically(os.path.basename(file), data, 0o600)


def remove(file: str) -> None:
    """Forget a cached file (best effort)."""
    held = _held(os.path.dirname(file), create=False)
    if held is None:
        return
    with held, contextlib.suppress(OSError, ValueError):
        held.unlink(os.path.basename(file))


def prune(prefix: str, keep: int) -> None:
    """Keep the `keep` newest files whose names start with path(prefix)'s; drop the rest."""
    held = _held(directory(), create=False)
    if held is None:
        return
    start = os.path.basename(path(prefix))
    with held, contextlib.suppress(OSError):
        named = [n for n in held.listdir() if n.startswith(start)]
        ages = sorted(named, key=lambda n: held.lstat(n).st_mtime_ns, reverse=True)
        for name in ages[keep:]:
            with contextlib.suppress(OSError):
                held.unlink(name)
