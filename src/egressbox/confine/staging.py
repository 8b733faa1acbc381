"""The way back: a run's writes staged in a copy-on-write layer, applied to the host by a gate.

In the child's view each writable directory grant is an overlayfs whose lower directory is the
host's directory and whose upper directory is this run's layer, in egressbox's own state
directory (never inside a root, never granted). The child writes only the layer. When it has
exited, the unconfined `run` process applies the layer to the host:

- it walks the upper directory from a directory descriptor, and reaches the host only from the
  root's handle taken before the child started, with ``openat2(RESOLVE_BENEATH |
  RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS)``: a symlink on the host (there now, whoever put
  it there) stops the entry, never leads outside the root;
- files are renamed into place (one ``rename(2)`` each: never a half-written file), or copied to
  a temporary name and renamed when the layer is on another file system; directories are made
  or merged, an opaque directory replaces the host's contents, a whiteout deletes, a symlink is
  moved as a symlink; setuid and setgid bits and overlayfs's own attributes are stripped;
  fifos, sockets and devices are skipped and named;
- entries that the host trusts are **held back** (held_reason(), one table with a reason per
  entry): git's control files (a new repository's too: its data lands), a replaced ``.git``
  or a new ``.git`` file or link, shell start-up files, ``.envrc``, editor
  task directories, egressbox's own files, and any deletion or replacement of a directory that
  holds such a name. They stay in the layer, are named, and are applied only on request.

Every applied entry leaves the upper directory as it lands (a rename moves it; a deleted
whiteout goes after the deletion), so an apply killed midway is resumed by the next call from
where it stopped; the one temporary copy in flight is named in the layer's journal and removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import stat
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from egressbox.confine.grants import SHELL_STARTUP

# -- openat2 ---------------------------------------------------------------------------------

SYS_OPENAT2 = 437  # x86-64 and aarch64 (asm-generic) alike
RESOLVE_NO_MAGICLINKS = 0x02
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
SAFE_RESOLVE = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_syscall = _libc.syscall
_syscall.restype = ctypes.c_long


def openat2(dirfd: int, path: str, flags: int, resolve: int = SAFE_RESOLVE) -> int:
    """openat2(2): `path` below `dirfd`, never through a symlink (ELOOP / EXDEV otherwise)."""
    how = _OpenHow(flags | os.O_CLOEXEC, 0, resolve)
    fd = _syscall(
        ctypes.c_long(SYS_OPENAT2),
        ctypes.c_int(dirfd),
        ctypes.c_char_p(os.fsencode(path)),
        ctypes.byref(how),
        ctypes.c_size_t(ctypes.sizeof(how)),
    )
    if fd < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{os.strerror(err)}: {path}")
    return int(fd)


# -- the overlay's options -------------------------------------------------------------------

# redirect_dir=nofollow: no redirect is made (a directory rename in the child gets EXDEV and
# tools copy), none followed; metacopy=off: every copied-up file holds its data; index=off,
# xino=off: no inode index. The upper then holds only plain entries, whiteouts and opaque
# directories. (The kernel refuses userxattr with redirect_dir=off: measured.)
OVERLAY_OPTIONS = "redirect_dir=nofollow,metacopy=off,index=off,xino=off"
OVERLAY_XATTR_PREFIXES = ("user.overlay.", "trusted.overlay.")
OPAQUE_XATTRS = ("user.overlay.opaque", "trusted.overlay.opaque")
WHITEOUT_XATTRS = ("user.overlay.whiteout", "trusted.overlay.whiteout")
# Attributes a file never carries into the host's tree (file capabilities, overlay's own).
STRIPPED_XATTRS = ("security.capability",)


def overlay_options(lower: str, upper: str, work: str, *, user_namespace: bool) -> str:
    own = f"lowerdir={lower},upperdir={upper},workdir={work},{OVERLAY_OPTIONS}"
    return own + (",userxattr" if user_namespace else "")


class StagingSpec(NamedTuple):
    """What the launcher stages: (host dir, upper, work) per writable grant, and the
    directories bound directly on top (egressbox's scratch space: temp files and caches)."""

    layers: tuple[tuple[str, str, str], ...]
    direct: tuple[str, ...] = ()


# -- what is held back (pure) ----------------------------------------------------------------

# Names held back at any depth, with the reason code said and recorded for each.
HELD_NAMES: dict[str, str] = {
    **dict.fromkeys(SHELL_STARTUP, "shell_startup"),
    ".envrc": "direnv",  # direnv runs it on cd
    ".vscode": "editor_tasks",  # tasks.json, settings that name programs
    ".idea": "editor_tasks",
    "egressbox.toml": "egressbox_own",  # the project's policy
}
# Inside a .git directory: files git reads as configuration or runs (the reason: git_control).
GIT_CONTROL_FILES = frozenset({"config", "config.worktree", "commondir", "gitdir"})
GIT_CONTROL_TREES = frozenset({"hooks", "info"})
GIT_CONTROL_PATHS = frozenset(
    {("objects", "info", "alternates"), ("objects", "info", "http-alternates")}
)
# Directories inside .git that hold another git directory's control files.
GIT_NESTED = frozenset({"modules", "worktrees"})
# Kinds of entries in an upper directory.
FILE, DIR, OPAQUE, SYMLINK, WHITEOUT, OTHER = (
    "file",
    "dir",
    "opaque",
    "symlink",
    "whiteout",
    "other",
)
DESTRUCTIVE = frozenset({OPAQUE, WHITEOUT})


class Rules(NamedTuple):
    """What one root holds back beyond the table: egressbox's own files (relative parts) and
    what --writable-trusted lifted; `git_dir` when the root itself is a git directory."""

    own: tuple[tuple[str, ...], ...] = ()
    lifted: tuple[tuple[str, ...], ...] = ()
    git_dir: bool = False


def _under(parts: Sequence[str], top: Sequence[str]) -> bool:
    return tuple(parts[: len(top)]) == tuple(top)


def _git_control(rest: Sequence[str]) -> bool:
    """Whether `rest` (a path inside a .git directory) is a control file or tree."""
    if not rest:
        return False
    if rest[0] in GIT_CONTROL_TREES:
        return True
    if len(rest) == 1 and rest[0] in GIT_CONTROL_FILES:
        return True
    if tuple(rest) in GIT_CONTROL_PATHS:
        return True
    if rest[0] in GIT_NESTED and len(rest) > 2:
        # modules/NAME/... and worktrees/NAME/... are git directories too (a submodule's name
        # may hold slashes: every split is tried).
        return any(_git_control(rest[i:]) for i in range(2, len(rest)))
    return False


def _git_control_ancestor(rest: Sequence[str]) -> bool:
    """Whether deleting or replacing `rest` (inside .git) would take control files with it."""
    if not rest:
        return True
    if rest[0] in GIT_NESTED:
        return True
    return any(tuple(rest) == p[: len(rest)] for p in GIT_CONTROL_PATHS)


def trusted_name(parts: Sequence[str]) -> str | None:
    """The reason when a path is host-trusted by its names alone (any depth), else None."""
    for index, name in enumerate(parts):
        if name == ".git":
            if _git_control(parts[index + 1 :]):
                return "git_control"
            continue
        reason = HELD_NAMES.get(name)
        if reason is not None:
            return reason
        if name == ".config" and tuple(parts[index + 1 : index + 2]) == ("fish",):
            return "shell_startup"
    return None


def held_reason(
    parts: Sequence[str],
    kind: str,
    host_kind: str | None,
    rules: Rules | None = None,
    holds_trusted: Callable[[], bool] = lambda: False,
) -> str | None:
    """Why the entry at `parts` (relative to its root) is held back, or None to apply it.

    `kind` is the upper's entry (FILE, DIR, OPAQUE, SYMLINK, WHITEOUT, OTHER), `host_kind` the
    host's entry there now (None: absent). `holds_trusted()` says whether the host's entry
    holds a trusted name below it (asked only for a deletion or replacement of a directory).
    """
    rules = rules or Rules()
    if any(_under(parts, top) for top in rules.lifted):
        return None
    if any(_own(parts, own) for own in rules.own):
        return "egressbox_own"  # the policy, the audit log and its rotations, caches
    full = (".git", *parts) if rules.git_dir else tuple(parts)
    replaced = host_kind is not None and (kind in DESTRUCTIVE or _kind_changed(kind, host_kind))
    reason = trusted_name(full) or _git_entry(full, kind, host_kind, replaced)
    if reason is None and replaced and host_kind == DIR and holds_trusted():
        reason = "trusted_ancestor"
    return reason


def _own(parts: Sequence[str], own: Sequence[str]) -> bool:
    """At or below one of egressbox's files, or a rotation of it (audit.jsonl.1)."""
    if _under(parts, own):
        return True
    same_dir = len(parts) == len(own) and tuple(parts[:-1]) == tuple(own[:-1])
    return same_dir and parts[-1].startswith(own[-1] + ".")


def _git_entry(
    full: tuple[str, ...], kind: str, host_kind: str | None, replaced: bool
) -> str | None:
    """A new, deleted or replaced .git, or what takes git control files with it."""
    if full[-1:] == (".git",):
        if host_kind is None:
            # A new repository (git clone, git init): its data (objects, refs, HEAD, index) is
            # applied and whatever git would run or follow inside it (config, hooks, info,
            # commondir...) is held by the table, so the host's git runs nothing it wrote. A
            # .git file or link would send git elsewhere whole: held.
            return None if kind in (DIR, OPAQUE) else "new_git_entry"
        if replaced or kind in (FILE, SYMLINK):
            return "git_replaced"
        return None
    if ".git" in full and replaced:
        inside = full[len(full) - full[::-1].index(".git") :]
        if _git_control_ancestor(inside):
            return "git_control"
    return None


def _kind_changed(kind: str, host_kind: str) -> bool:
    upper_dir = kind in (DIR, OPAQUE)
    return upper_dir != (host_kind == DIR) or (not upper_dir and kind != host_kind)


def host_kind_of(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return DIR
    if stat.S_ISLNK(mode):
        return SYMLINK
    if stat.S_ISREG(mode):
        return FILE
    return OTHER


# -- the apply (I/O) -------------------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
TEMP_PREFIX = ".egressbox-apply-"
# Bytes copied per call when the layer is on another file system than the root.
COPY_CHUNK = 1 << 30
# Hook for the crash test: after this many applied entries the apply SIGKILLs itself.
ENV_KILL_AFTER = "EGRESSBOX_TEST_APPLY_KILL_AFTER"


class Change(NamedTuple):
    """One entry of a layer: its path on the host, what it does, and why it is held."""

    path: str
    action: str  # added | modified | deleted | replaced | skipped
    kind: str
    held: str = ""  # a reason code when held back


class Outcome(NamedTuple):
    applied: list[Change]
    held: list[Change]
    failed: list[tuple[str, str]]  # (path, why): left in the layer
    skipped: list[Change]  # fifos, sockets, devices: never applied


class Journal:
    """The temporary copy in flight (one at a time), so that a resumed apply removes it."""

    def __init__(self, layer_fd: int) -> None:
        self.layer_fd = layer_fd

    def begin(self, root: int, rel_dir: str, name: str) -> None:
        self._write(f"{root}\n{rel_dir}\n{name}\n")

    def end(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(JOURNAL, dir_fd=self.layer_fd)

    def _write(self, text: str) -> None:
        tmp = JOURNAL + ".new"
        fd = os.open(
            tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600, dir_fd=self.layer_fd
        )
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, JOURNAL, src_dir_fd=self.layer_fd, dst_dir_fd=self.layer_fd)

    def pending(self) -> tuple[int, str, str] | None:
        try:
            fd = os.open(JOURNAL, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=self.layer_fd)
        except FileNotFoundError:
            return None
        try:
            lines = os.read(fd, 1 << 16).decode("utf-8", "replace").split("\n")
        finally:
            os.close(fd)
        if len(lines) < 3 or not lines[0].isdigit():
            return None
        return int(lines[0]), lines[1], lines[2]


JOURNAL = "journal"


def _xattr(fd: int, names: Sequence[str]) -> bytes | None:
    for name in names:
        with contextlib.suppress(OSError):
            return os.getxattr(fd, name)
    return None


def entry_kind(dir_fd: int, name: str, st: os.stat_result) -> str:
    """The kind of an upper entry (whiteouts in both forms, opaque directories)."""
    mode = st.st_mode
    if stat.S_ISCHR(mode) and st.st_rdev == 0:
        return WHITEOUT
    if stat.S_ISLNK(mode):
        return SYMLINK
    if stat.S_ISDIR(mode):
        fd = _open_upper_dir(dir_fd, name)
        try:
            return OPAQUE if _xattr(fd, OPAQUE_XATTRS) == b"y" else DIR
        finally:
            os.close(fd)
    if stat.S_ISREG(mode):
        if st.st_size == 0:
            fd = os.open(
                name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd
            )
            try:
                if _xattr(fd, WHITEOUT_XATTRS) is not None:
                    return WHITEOUT
            finally:
                os.close(fd)
        return FILE
    return OTHER


def _open_upper_dir(dir_fd: int, name: str) -> int:
    """An upper directory, made searchable for us first if the child took that away (we own
    the layer; the host gets the mode the child gave it)."""
    try:
        return os.open(name, _DIR_FLAGS | os.O_CLOEXEC, dir_fd=dir_fd)
    except PermissionError:
        path = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            os.chmod(f"/proc/self/fd/{path}", stat.S_IMODE(os.fstat(path).st_mode) | stat.S_IRWXU)
        finally:
            os.close(path)
        return os.open(name, _DIR_FLAGS | os.O_CLOEXEC, dir_fd=dir_fd)


class Target(NamedTuple):
    """Where one root's layer is applied: the host root's handle, its path, its rules."""

    number: int
    root_fd: int
    path: str
    rules: Rules
    # (uid, gid) that what the apply creates is given to (`run --user NAME`: root applies,
    # NAME owns); None: the applier's own.
    owner: tuple[int, int] | None = None


class Selection(NamedTuple):
    """Which entries an apply takes: all (paths empty) or those at or below `paths`."""

    paths: tuple[tuple[str, ...], ...] = ()
    include_held: bool = False

    def wants(self, parts: tuple[str, ...]) -> bool:
        return not self.paths or any(_under(parts, p) for p in self.paths)

    def leads_to(self, parts: tuple[str, ...]) -> bool:
        return any(_under(p, parts) for p in self.paths)

    def named(self, parts: tuple[str, ...]) -> bool:
        return any(_under(parts, p) for p in self.paths)


class _Entry(NamedTuple):
    parts: tuple[str, ...]
    kind: str
    host_kind: str | None
    st: os.stat_result
    wanted: bool
    change: Change


class _Apply:
    def __init__(
        self, target: Target, journal: Journal, selection: Selection, *, dry_run: bool = False
    ) -> None:
        self.target = target
        self.journal = journal
        self.selection = selection
        self.dry_run = dry_run
        self.outcome = Outcome([], [], [], [])
        self.count = 0
        self.kill_after = int(os.environ.get(ENV_KILL_AFTER, "0") or 0)

    def path(self, parts: tuple[str, ...]) -> str:
        return os.path.join(self.target.path, *parts)

    def walk(self, up_fd: int, host_fd: int | None, parts: tuple[str, ...]) -> None:
        for name in sorted(os.listdir(up_fd)):
            here = (*parts, name)
            try:
                self.entry(up_fd, host_fd, here)
            except OSError as exc:
                self.outcome.failed.append((self.path(here), exc.strerror or str(exc)))

    def entry(self, up_fd: int, host_fd: int | None, parts: tuple[str, ...]) -> None:
        name = parts[-1]
        st = os.stat(name, dir_fd=up_fd, follow_symlinks=False)
        kind = entry_kind(up_fd, name, st)
        host = _lstat(host_fd, name)
        host_kind = host_kind_of(host.st_mode) if host is not None else None
        wanted = self.selection.wants(parts)
        if not wanted and not (kind in (DIR, OPAQUE) and self.selection.leads_to(parts)):
            return
        reason = held_reason(
            parts,
            kind,
            host_kind,
            self.target.rules,
            lambda: host_fd is not None and _holds_trusted(host_fd, name, parts, self.target.rules),
        )
        change = Change(self.path(parts), _action(kind, host_kind), kind, reason or "")
        # Held unless asked for: by --include-held, by name, or on the way to a named path.
        asked = self.selection.include_held or self.selection.named(parts) or not wanted
        if reason and not asked:
            if kind == DIR and host is not None and host_kind == DIR and host.st_mode == st.st_mode:
                # A trusted directory merged as it was (.git/hooks): what is held is named one
                # by one below it; the directory itself is left as the host has it.
                self._descend(up_fd, host_fd, _Entry(parts, kind, host_kind, st, False, change))
                return
            self.outcome.held.append(change)
            return
        if kind == OTHER:
            self.outcome.skipped.append(change._replace(action="skipped"))
            return
        if self.dry_run and kind not in (DIR, OPAQUE):
            self.outcome.applied.append(change)
            return
        if host_fd is None and not self.dry_run:
            raise OSError(errno.ENOENT, "its directory is missing on the host")
        if kind in (DIR, OPAQUE):
            self._descend(up_fd, host_fd, _Entry(parts, kind, host_kind, st, wanted, change))
            return
        assert host_fd is not None
        if host_kind == DIR:
            _remove_tree(host_fd, name)
        if kind == WHITEOUT:
            if host_kind is not None and host_kind != DIR:
                os.unlink(name, dir_fd=host_fd)
            os.unlink(name, dir_fd=up_fd)
        elif kind == FILE:
            self._file(up_fd, host_fd, parts, st)
        else:
            self._move(up_fd, host_fd, name)
        self.outcome.applied.append(change)
        self._tick()

    def _descend(self, up_fd: int, host_fd: int | None, entry: _Entry) -> None:
        parts, kind, host_kind, wanted = entry.parts, entry.kind, entry.host_kind, entry.wanted
        name = parts[-1]
        sub_up = _open_upper_dir(up_fd, name)
        sub_host: int | None = None
        try:
            if self.dry_run:
                if host_fd is not None and kind == DIR and host_kind == DIR:
                    sub_host = openat2(host_fd, name, _DIR_FLAGS)
            elif host_fd is not None:
                sub_host = self._host_dir(host_fd, sub_up, entry)
            if wanted and (kind == OPAQUE or host_kind != DIR):
                self.outcome.applied.append(entry.change)
            self.walk(sub_up, sub_host, parts)
        finally:
            os.close(sub_up)
            if sub_host is not None:
                os.close(sub_host)
        if wanted and not self.dry_run:
            with contextlib.suppress(OSError):  # not empty: held or failed entries stay
                os.rmdir(name, dir_fd=up_fd)

    def _host_dir(self, host_fd: int, sub_up: int, entry: _Entry) -> int:
        """The host's directory for an upper one: made, replaced or cleared as it says."""
        name, kind, host_kind, wanted = entry.parts[-1], entry.kind, entry.host_kind, entry.wanted
        st = entry.st
        mode = stat.S_IMODE(st.st_mode) & ~stat.S_ISUID
        if host_kind is not None and host_kind != DIR:
            os.unlink(name, dir_fd=host_fd)  # a file or symlink replaced by a directory
            host_kind = None
        if host_kind is None:
            os.mkdir(name, mode | stat.S_IRWXU, dir_fd=host_fd)
        sub_host = openat2(host_fd, name, _DIR_FLAGS)
        try:
            if host_kind is None:
                self._give(sub_host)
            if kind == OPAQUE and wanted:
                # The child replaced the directory: the host's contents go, then the mark, so
                # that a resumed apply never clears what was applied since.
                for child in os.listdir(sub_host):
                    _remove_any(sub_host, child)
                for attr in OPAQUE_XATTRS:
                    with contextlib.suppress(OSError):
                        os.removexattr(sub_up, attr)
            if wanted and stat.S_IMODE(os.fstat(sub_host).st_mode) != mode:
                os.chmod(sub_host, mode)
        except BaseException:
            os.close(sub_host)
            raise
        return sub_host

    def _file(self, up_fd: int, host_fd: int, parts: tuple[str, ...], st: os.stat_result) -> None:
        name = parts[-1]
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=up_fd)
        try:
            if st.st_mode & (stat.S_ISUID | stat.S_ISGID):
                os.chmod(fd, stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID))
            _strip_xattrs(fd)
            if st.st_nlink > 1:
                # Another name in the layer shares this inode: a copy, never a link between
                # two host files.
                self._copy(fd, host_fd, parts, st)
                os.unlink(name, dir_fd=up_fd)
                return
        finally:
            os.close(fd)
        try:
            os.rename(name, name, src_dir_fd=up_fd, dst_dir_fd=host_fd)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=up_fd)
            try:
                self._copy(fd, host_fd, parts, st)
            finally:
                os.close(fd)
            os.unlink(name, dir_fd=up_fd)

    def _copy(self, src: int, host_fd: int, parts: tuple[str, ...], st: os.stat_result) -> None:
        """To a temporary name in the host's directory, then renamed over the entry."""
        temp = f"{TEMP_PREFIX}{os.getpid()}"
        self.journal.begin(self.target.number, "/".join(parts[:-1]), temp)
        mode = stat.S_IMODE(st.st_mode) & ~(stat.S_ISUID | stat.S_ISGID)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp, dir_fd=host_fd)
        out = os.open(temp, flags, 0o600, dir_fd=host_fd)
        try:
            try:
                _copy_bytes(src, out, st.st_size)
                self._give(out)
                os.chmod(out, mode)
                os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
            finally:
                os.close(out)
            os.rename(temp, parts[-1], src_dir_fd=host_fd, dst_dir_fd=host_fd)
        except BaseException:
            with contextlib.suppress(OSError):  # the entry stays in the layer, named as failed
                os.unlink(temp, dir_fd=host_fd)
            raise
        self.journal.end()

    def _move(self, up_fd: int, host_fd: int, name: str) -> None:
        """A symlink: moved as itself (never followed), or made again on another file system."""
        try:
            os.rename(name, name, src_dir_fd=up_fd, dst_dir_fd=host_fd)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
            target = os.readlink(name, dir_fd=up_fd)
            temp = f"{TEMP_PREFIX}{os.getpid()}"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=host_fd)
            os.symlink(target, temp, dir_fd=host_fd)
            if self.target.owner is not None:
                os.chown(temp, *self.target.owner, dir_fd=host_fd, follow_symlinks=False)
            os.rename(temp, name, src_dir_fd=host_fd, dst_dir_fd=host_fd)
            os.unlink(name, dir_fd=up_fd)

    def _give(self, fd: int) -> None:
        """What the apply made (a directory, a copy) goes to the target's owner, by
        descriptor: never through a link. Renamed entries keep the owner the layer gave them
        (the command's, set by the kernel when it wrote them)."""
        if self.target.owner is not None:
            os.fchown(fd, *self.target.owner)

    def _tick(self) -> None:
        self.count += 1
        if self.kill_after and self.count >= self.kill_after:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


# copy_file_range(2) refuses some pairs of file systems (EXDEV from a tmpfs layer to ext4
# here, kernel 6.18): the bytes are then read and written, a MiB at a time.
_NO_COPY_RANGE = (errno.EXDEV, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOSYS)
_READ_CHUNK = 1 << 20


def _copy_bytes(src: int, out: int, size: int) -> None:
    offset = 0
    while offset < size:
        try:
            sent = os.copy_file_range(src, out, min(COPY_CHUNK, size - offset), offset)
        except OSError as exc:
            if exc.errno not in _NO_COPY_RANGE:
                raise
            break
        if sent <= 0:
            return
        offset += sent
    while offset < size:
        data = os.pread(src, min(_READ_CHUNK, size - offset), offset)
        if not data:
            return
        _write_all(out, data)
        offset += len(data)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _action(kind: str, host_kind: str | None) -> str:
    if kind == WHITEOUT:
        return "deleted"
    if host_kind is None:
        return "added"
    if _kind_changed(kind, host_kind) or kind == OPAQUE:
        return "replaced"
    return "modified"


def _lstat(dir_fd: int | None, name: str) -> os.stat_result | None:
    if dir_fd is None:
        return None
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def _strip_xattrs(fd: int) -> None:
    try:
        names = os.listxattr(fd)
    except OSError:
        return
    for attr in names:
        if attr.startswith(OVERLAY_XATTR_PREFIXES) or attr in STRIPPED_XATTRS:
            with contextlib.suppress(OSError):
                os.removexattr(fd, attr)


def _remove_any(dir_fd: int, name: str) -> None:
    st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISDIR(st.st_mode):
        _remove_tree(dir_fd, name)
    else:
        os.unlink(name, dir_fd=dir_fd)


def _remove_tree(dir_fd: int, name: str) -> None:
    """rm -r of `name` below `dir_fd`, never through a symlink (each level opened O_NOFOLLOW)."""
    fd = os.open(name, _DIR_FLAGS | os.O_CLOEXEC, dir_fd=dir_fd)
    try:
        for child in os.listdir(fd):
            _remove_any(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=dir_fd)


# Host entries looked at, at most, to decide whether a deleted directory held a trusted name;
# beyond it the deletion is held (a hostile tree cannot make the gate walk forever).
TRUSTED_SCAN_LIMIT = 200_000


def _holds_trusted(dir_fd: int, name: str, parts: tuple[str, ...], rules: Rules) -> bool:
    budget = [TRUSTED_SCAN_LIMIT]

    def scan(fd: int, here: tuple[str, ...]) -> bool:
        for entry in os.scandir(fd):
            budget[0] -= 1
            if budget[0] < 0:
                return True
            below = (*here, entry.name)
            if entry.name == ".git" or held_reason(below, FILE, FILE, rules) is not None:
                return True
            if entry.is_dir(follow_symlinks=False):
                sub = os.open(entry.name, _DIR_FLAGS | os.O_CLOEXEC, dir_fd=fd)
                try:
                    if scan(sub, below):
                        return True
                finally:
                    os.close(sub)
        return False

    try:
        fd = os.open(name, _DIR_FLAGS | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return True
    try:
        return scan(fd, parts)
    except OSError:
        return True
    finally:
        os.close(fd)


def apply_tree(
    upper_fd: int, target: Target, journal: Journal, selection: Selection | None = None
) -> Outcome:
    """Apply one root's upper directory to the host through the gate."""
    work = _Apply(target, journal, selection or Selection())
    work.walk(upper_fd, target.root_fd, ())
    return work.outcome


def list_tree(upper_fd: int, target: Target) -> Outcome:
    """What apply_tree would do, changing nothing (`egressbox changes`)."""
    work = _Apply(target, journal=Journal(-1), selection=Selection(), dry_run=True)
    work.walk(upper_fd, target.root_fd, ())
    return work.outcome


def apply_layer(
    layer_fd: int,
    targets: Sequence[Target],
    open_upper: Callable[[int], int],
    selections: Mapping[int, Selection] | None = None,
) -> Outcome:
    """The way back for a whole layer (its directory: `layer_fd`, which holds the journal):
    a copy an earlier apply left in flight is removed first, then each root's upper
    (`open_upper(number)`, closed here) is applied through the gate. With `selections`, a
    root nothing is named below is left as it is."""
    journal = Journal(layer_fd)
    remove_journal_temp(journal, targets)
    total = Outcome([], [], [], [])
    for target in targets:
        selection = None if selections is None else selections.get(target.number)
        if selections is not None and selection is None:
            continue
        upper = open_upper(target.number)
        try:
            _add(total, apply_tree(upper, target, journal, selection))
        finally:
            os.close(upper)
    return total


def layer_changes(targets: Sequence[Target], open_upper: Callable[[int], int]) -> Outcome:
    """What apply_layer would do, changing nothing (`egressbox changes`)."""
    total = Outcome([], [], [], [])
    for target in targets:
        upper = open_upper(target.number)
        try:
            _add(total, list_tree(upper, target))
        finally:
            os.close(upper)
    return total


def _add(total: Outcome, done: Outcome) -> None:
    total.applied.extend(done.applied)
    total.held.extend(done.held)
    total.failed.extend(done.failed)
    total.skipped.extend(done.skipped)


def remove_journal_temp(journal: Journal, targets: Sequence[Target]) -> None:
    """A copy that an earlier apply left in flight (killed midway): removed, never renamed."""
    pending = journal.pending()
    if pending is None:
        return
    index, rel_dir, name = pending
    for target in targets:
        if target.number != index or not name.startswith(TEMP_PREFIX) or "/" in name:
            continue
        with contextlib.suppress(OSError):
            fd = openat2(target.root_fd, rel_dir or ".", _DIR_FLAGS)
            try:
                os.unlink(name, dir_fd=fd)
            finally:
                os.close(fd)
    journal.end()
