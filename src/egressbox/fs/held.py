"""Directories held by descriptor: where the host writes its own files, beside a child.

egressbox creates files as the invoker (often root) in directories a user names: the audit log
and its rotations, ``--save-approved``'s policy, its own state. A confined child that can write
near such a directory could replace a directory on the way with a symbolic link, and a later
write by path would land wherever the link points. So each such directory is resolved once, at
start, before any child runs, and held:

- The path is resolved to its real path then (``os.path.realpath``): the symbolic links it has
  at that moment are the user's own (``/var/log -> /srv/log`` made by an administrator keeps
  working), since no child has run yet.
- That real path is opened from ``/`` one component at a time, each relative to the descriptor
  of the one before, with ``O_NOFOLLOW``: no component may be a symbolic link, and nothing
  swapped in between two steps is followed. This is the guarantee of ``openat2`` with
  ``RESOLVE_NO_SYMLINKS``, made with the os module alone: ctypes would add 1.4 ms to every
  start, and some kernels (before 5.6) and container seccomp profiles have no openat2.
- Every later open, rename and unlink is made relative to the held descriptor, and never
  follows a final symbolic link. Whatever is done to the path afterwards (the directory
  renamed, a link put in its place), the files go where the directory was at start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from types import TracebackType
from typing import Final, Self

# Directory descriptors for the walk: O_PATH needs no read permission on the components (a
# 0711 home directory), only search permission, as a path lookup does.
_STEP_FLAGS: Final = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_HELD_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Attempts at a unique temporary name before giving up (O_EXCL collisions are not expected:
# the name carries the pid and random bytes).
_TEMP_ATTEMPTS: Final = 8


class SymlinkOnPathError(OSError):
    """A component of a held directory's real path is a symbolic link (planted after the path
    was resolved, or made between resolving and opening)."""

    def __init__(self, component: str) -> None:
        super().__init__(
            errno.ELOOP,
            f"{component} is a symbolic link; refusing to follow it (it was not one when the "
            "path was resolved: something replaced it)",
        )
        self.filename = component

    def __str__(self) -> str:
        return str(self.strerror)


class DirectoryRemovedError(FileNotFoundError):
    """The held directory was deleted after it was opened: nothing is written, anywhere."""

    def __init__(self, path: str) -> None:
        super().__init__(
            errno.ENOENT,
            f"its directory {path} was removed after egressbox opened it at start; "
            "nothing was written (and nothing anywhere else)",
        )

    def __str__(self) -> str:
        return str(self.strerror)


def component(name: str) -> str:
    """``name`` if it is one plain path component; ValueError otherwise."""
    if not name or name in (".", "..") or "/" in name or "\0" in name:
        raise ValueError(f"not a single file name: {name!r}")
    return name


class HeldDir:
    """A directory opened once by its real path; every file operation goes through its fd."""

    __slots__ = ("_fd", "path")

    def __init__(self, fd: int, path: str) -> None:
        self._fd: int | None = fd
        self.path = path  # the real path at start, for messages only

    @classmethod
    def open(cls, path: str | os.PathLike[str], *, create_mode: int | None = None) -> HeldDir:
        """Resolve ``path`` now and hold it; with ``create_mode``, make missing directories.

        Raises OSError (SymlinkOnPathError when a component turned into a symbolic link).
        """
        real = os.path.realpath(os.fspath(path) or ".")
        return cls(_walk(real, create_mode), real)

    def fileno(self) -> int:
        if self._fd is None:
            raise OSError(errno.EBADF, f"held directory {self.path} is closed")
        return self._fd

    def open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """openat(held, name, flags | O_NOFOLLOW | O_CLOEXEC): never through a final link."""
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(component(name), flags, mode, dir_fd=self.fileno())

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(component(name), dir_fd=self.fileno(), follow_symlinks=False)

    def exists(self, name: str) -> bool:
        try:
            self.lstat(name)
        except FileNotFoundError:
            return False
        return True

    def replace(self, source: str, target: str) -> None:
        """rename(2) within the held directory (a link named ``target`` is replaced, unfollowed)."""
        fd = self.fileno()
        os.replace(component(source), component(target), src_dir_fd=fd, dst_dir_fd=fd)

    def unlink(self, name: str) -> None:
        os.unlink(component(name), dir_fd=self.fileno())

    def listdir(self) -> list[str]:
        fd = os.open(".", _HELD_FLAGS, dir_fd=self.fileno())
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def write_atomically(self, name: str, data: bytes, mode: int) -> None:
        """``name`` holds exactly ``data`` (mode ``mode``) or is left as it was: a temporary
        file beside it, flushed to disk, then renamed over it."""
        temporary, fd = self._temporary(name)
        try:
            try:
                os.fchmod(fd, mode)  # exactly this mode, whatever the umask
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            self.replace(temporary, name)
        except BaseException:
            with contextlib.suppress(OSError):
                self.unlink(temporary)
            raise

    def _temporary(self, name: str) -> tuple[str, int]:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
        for _ in range(_TEMP_ATTEMPTS):
            temporary = f".{component(name)}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
            try:
                return temporary, self.open_file(temporary, flags, 0o600)
            except FileExistsError:
                continue
            except FileNotFoundError:
                self._check_not_removed()
                raise
        raise FileExistsError(errno.EEXIST, f"no free temporary name beside {name} in {self.path}")

    def _check_not_removed(self) -> None:
        """Say so when the held directory itself was deleted (moved away and removed)."""
        try:
            gone = os.fstat(self.fileno()).st_nlink == 0
        except OSError:
            return
        if gone:
            raise DirectoryRemovedError(self.path)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        # A forgotten HeldDir must not leak its descriptor (never inherited: O_CLOEXEC).
        with contextlib.suppress(OSError, AttributeError):
            self.close()


class HeldFile:
    """A file to be written later (``--save-approved``), its directory held from now on."""

    __slots__ = ("directory", "name", "path")

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        folder, name = os.path.split(self.path)
        if not name:
            raise IsADirectoryError(errno.EISDIR, f"{self.path} names a directory, not a file")
        self.name = component(name)
        self.directory = HeldDir.open(folder or ".")

    def write(self, data: bytes, mode: int) -> None:
        self.directory.write_atomically(self.name, data, mode)

    def close(self) -> None:
        self.directory.close()


def _walk(real: str, create_mode: int | None) -> int:
    """The held descriptor of the absolute, resolved path ``real`` (see the module's doc)."""
    parts = [part for part in real.split("/") if part]
    fd = os.open("/", _STEP_FLAGS if parts else _HELD_FLAGS)
    try:
        for index, part in enumerate(parts):
            last = index == len(parts) - 1
            prefix = "/" + "/".join(parts[: index + 1])
            following = _step(fd, part, prefix, last=last, create_mode=create_mode)
            os.close(fd)
            fd = following
    except BaseException:
        os.close(fd)
        raise
    return fd


def _step(parent: int, part: str, prefix: str, *, last: bool, create_mode: int | None) -> int:
    try:
        return _open_step(parent, part, prefix, last=last)
    except FileNotFoundError:
        if create_mode is None:
            raise
    with contextlib.suppress(FileExistsError):
        os.mkdir(part, create_mode, dir_fd=parent)
    return _open_step(parent, part, prefix, last=last)


def _open_step(parent: int, part: str, prefix: str, *, last: bool) -> int:
    try:
        if last:
            try:
                return os.open(part, _HELD_FLAGS, dir_fd=parent)
            except PermissionError:
                pass  # search permission only: held as O_PATH (no listing, the rest works)
        return os.open(part, _STEP_FLAGS, dir_fd=parent)
    except OSError as exc:
        if exc.errno in (errno.ENOTDIR, errno.ELOOP) and _is_link(parent, part):
            raise SymlinkOnPathError(prefix) from None
        raise


def _is_link(parent: int, part: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        return False
