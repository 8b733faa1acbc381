"""`serve --watch-policy`: reload when the policy file changes, by the path SIGHUP takes.

The file's identity is polled once a second: (device, inode, mtime, size) of what the path
names now, through every symlink. That sees an editor's save (a new inode), an in-place write
(mtime, size) and a Kubernetes ConfigMap update, which the kubelet makes by writing a new
directory and swapping the `..data` symlink the mounted file points through (a new inode
under the same path). inotify would watch the directory and still have to follow the link
swap; a stat() per second costs nothing and works on every file system, including the network
ones where inotify sees no remote change.

A change is acted on once the identity has held still for one more poll, so a writer that
writes a file in place in several steps is not read half-way (an atomic rename is read one
poll later). A file that cannot be loaded keeps the old policy, as SIGHUP does; a file that is
gone is tried when it comes back.
"""

from __future__ import annotations

import os

# Seconds between looks at the file.
WATCH_INTERVAL = 1.0

Signature = tuple[int, int, int, int] | None


def signature(path: str) -> Signature:
    """(st_dev, st_ino, st_mtime_ns, st_size) of what `path` names now; None if nothing."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)


class PolicyWatch:
    """Made before the policy is first loaded, so a change during start-up is not missed."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._seen = signature(path)  # what the current policy was (or will be) read from
        self._pending: Signature | None = None
        self._has_pending = False

    def poll(self) -> bool:
        """True when the file should be reloaded now: it changed, then held still for one
        poll. Call every WATCH_INTERVAL."""
        now = signature(self.path)
        if self._has_pending and now == self._pending:
            self._seen, self._has_pending = now, False
            return True
        if now != self._seen:
            self._pending, self._has_pending = now, True
        else:
            self._has_pending = False
        return False
