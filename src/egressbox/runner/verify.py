"""The way back in direct mode: host-trusted paths checked after the run, and put right.

In direct mode the command writes its roots live. The child's view makes host-trusted paths
read-only and pins the directories above them (confine/world.py), but names that do not exist
yet (``.git/commondir``, a hook, a nested ``sub/.git``) cannot be covered without creating them
on the host. So, before the command starts, each host-trusted path is snapshotted (device,
inode, mode, size, mtime, a hash, and a copy in memory of files up to FILE_COPY_MAX; a
directory's listing with the same for each entry), along with every ``.git`` below each
workspace (a bounded walk). After the run, with the child's PID namespace gone:

- a changed path is moved aside and the copy taken before the run put back;
- a created one (a host-trusted name, a git control file, any new ``.git``) is moved aside;
- a directory above a host-trusted path that was swapped (``mv .git .git.old; mkdir .git``,
  possible without a mount namespace) is moved aside and the original looked for beside it;

nothing is deleted: what the command left goes to egressbox's state directory (opened before
the child started, held by descriptor), or, on another file system, is renamed in place to a
name no tool trusts. Every step is said on stderr and the run exits EXIT_TAMPERED.

Every host-side step walks from directory descriptors opened before the child started,
one component at a time with O_NOFOLLOW: a directory may have become a symlink during the run.
The window: while the run lasts, a host command reading the workspace (a shell prompt's
``git status``) may meet what the command created, before it is moved aside.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from collections.abc import Iterable, Sequence
from typing import NamedTuple

from egressbox.runner import own_state

# A copy is kept of each protected file up to this size (configs and hooks are a few KiB; git's
# sample hooks are under 5 KiB). A larger one is hashed and, when changed, moved aside only.
FILE_COPY_MAX = 1 << 20
# All copies of one run together (memory held for the run's length).
COPY_TOTAL_MAX = 32 << 20
# A protected directory (.git/hooks, .vscode, .idea, .config/fish) is listed to this many
# entries and this depth; beyond, it is compared but cannot be put back.
TREE_MAX_ENTRIES = 4096
TREE_MAX_DEPTH = 8
# The search for .git entries below each workspace, before and after the run: directories
# visited at most (this repository's checkout has ~400; a JavaScript project with a few hundred
# packages installed ~10k). Beyond it, the report says the search stopped.
WALK_MAX_DIRS = 20_000
# A file the host appends to (the audit log) is judged by the last bytes it had before the run.
TAIL_BYTES = 1 << 16
GIT = ".git"
# In each git directory: files git reads that the host trusts (code runs through config,
# core.fsmonitor / core.hooksPath; commondir and alternates send git to another directory).
GIT_CONTROL = ("config", "config.worktree", "commondir", "hooks", "objects/info/alternates")
STATE_SUBDIR = "held"
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class Entry(NamedTuple):
    """One path as the host saw it. `kind`: file, dir, link, other or absent."""

    kind: str
    dev: int = 0
    ino: int = 0
    mode: int = 0
    size: int = 0
    mtime_ns: int = 0
    digest: str = ""  # a file's sha256, a link's target
    data: bytes | None = None  # a file's copy (None: beyond the bound)
    children: tuple[tuple[str, Entry], ...] | None = None  # a directory's (None: beyond)

    def same(self, other: Entry) -> bool:
        if self.kind != other.kind:
            return False
        if self.kind == "dir":  # its own mtime moves with any lock file made and removed
            return (
                self.ino == other.ino
                and self.mode == other.mode
                and _same_children(self.children, other.children)
            )
        return self[:7] == other[:7]

    def complete(self) -> bool:
        """Whether it can be put back from this copy."""
        if self.kind == "file":
            return self.data is not None
        if self.kind == "dir":
            return self.children is not None and all(c.complete() for _, c in self.children)
        return self.kind == "link"


def _same_children(
    a: tuple[tuple[str, Entry], ...] | None, b: tuple[tuple[str, Entry], ...] | None
) -> bool:
    if a is None or b is None:
        return a is b
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1].same(y[1]) for x, y in zip(a, b, strict=True)
    )


class _Watched(NamedTuple):
    root: int  # index into Guard.roots
    parts: tuple[str, ...]  # components below the root
    chain: tuple[tuple[int, int], ...]  # (dev, ino) of the directories to its parent, as found
    before: Entry
    grows: bool  # written by the host during the run (the audit log): may only grow


class _Budget:
    def __init__(self) -> None:
        self.copied = 0


class Guard:
    """The snapshot of one run's host-trusted paths; settle() judges and puts right."""

    def __init__(self, roots: Sequence[str], state: int | None, state_path: str) -> None:
        self.roots = list(roots)
        self.fds: list[int] = []
        self.watched: list[_Watched] = []
        self.workspaces: list[str] = []
        self.gits: list[dict[str, tuple[int, int]]] = []  # per workspace: rel path -> id
        self.walk_cut: list[str] = []
        self.acted = False
        self.moved = 0
        self.stamp = time.strftime("%Y%m%d-%H%M%S")
        self.state = state
        self.state_path = state_path
        self.held_fd: int | None = None
        self.held_path = ""
        self.lines: list[str] = []
        self.settled = False

    def close(self) -> None:
        for fd in (*self.fds, self.state, self.held_fd):
            if fd is not None and fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.fds = []
        self.state = self.held_fd = None


def snapshot(
    roots: Sequence[str],
    protected: Iterable[str],
    *,
    workspaces: Sequence[str] = (),
    grows: Iterable[str] = (),
    state_dir: str | None = None,
) -> Guard:
    """Before the child starts: hold the roots, snapshot `protected`, find every `.git`.

    `roots`: the writable roots (real paths); a protected path outside all of them cannot be
    written by the child and is not watched. `workspaces`: searched for `.git` entries.
    `grows`: protected files the host itself appends to during the run.
    """
    where = state_dir if state_dir is not None else default_state_dir()
    guard = Guard(roots, _open_state(where), where)
    for root in guard.roots:
        try:
            guard.fds.append(os.open(root, _DIR))
        except OSError:
            guard.fds.append(-1)
    appended = set(grows)
    budget = _Budget()
    wanted = dict.fromkeys(protected)
    shallow: set[str] = set()
    for workspace in workspaces:
        if workspace not in guard.roots or guard.fds[guard.roots.index(workspace)] < 0:
            continue
        found = _find_gits(guard, workspace, guard.fds[guard.roots.index(workspace)])
        guard.workspaces.append(workspace)
        guard.gits.append(found)
        for rel in found:
            base = os.path.join(workspace, rel)
            shallow.add(base)  # a git directory is judged by identity, not by its objects
            wanted.update(dict.fromkeys(os.path.join(base, name) for name in GIT_CONTROL))
            wanted.update(dict.fromkeys(_module_control(guard, base)))
    for path in (*wanted, *(p for p in shallow if p not in wanted)):
        watched = _watch(guard, path, path in appended, budget, deep=path not in shallow)
        if watched is not None:
            guard.watched.append(watched)
    # Parents first: a swapped directory is dealt with before what it holds.
    guard.watched.sort(key=lambda w: len(w.parts))
    return guard


def default_state_dir() -> str:
    """Where moved-aside paths go: under egressbox's state directory (runner/own_state.py)."""
    return os.path.join(own_state.directory(), STATE_SUBDIR)


def _open_state(path: str) -> int | None:
    """mkdir -p, each component opened with O_NOFOLLOW from the one above; None if it fails."""
    if not os.path.isabs(path):
        return None
    try:
        fd = os.open("/", _DIR)
    except OSError:
        return None
    for part in [p for p in path.split("/") if p]:
        try:
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o700, dir_fd=fd)
            nxt = os.open(part, _DIR, dir_fd=fd)
        except OSError:
            os.close(fd)
            return None
        os.close(fd)
        fd = nxt
    return fd


def _locate(guard: Guard, path: str) -> tuple[int, tuple[str, ...]] | None:
    """(root index, components) of `path` under the outermost root holding it."""
    best: tuple[int, tuple[str, ...]] | None = None
    for index, root in enumerate(guard.roots):
        top = root.rstrip("/")
        if guard.fds[index] < 0 or not path.startswith(top + "/"):
            continue
        parts = tuple(p for p in path[len(top) :].split("/") if p)
        if parts and ".." not in parts and (best is None or len(parts) > len(best[1])):
            best = (index, parts)
    return best


def _walk_to(root_fd: int, parts: Sequence[str]) -> tuple[int, list[tuple[int, int]]]:
    """A descriptor on the parent of `parts` (caller closes), and the (dev, ino) chain.

    Raises OSError when a component is missing or not a directory (a symlink included).
    """
    fd = os.dup(root_fd)
    chain: list[tuple[int, int]] = []
    try:
        for part in parts[:-1]:
            nxt = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
            st = os.fstat(fd)
            chain.append((st.st_dev, st.st_ino))
    except OSError:
        os.close(fd)
        raise
    return fd, chain


def _watch(
    guard: Guard, path: str, grows: bool, budget: _Budget, *, deep: bool = True
) -> _Watched | None:
    located = _locate(guard, path)
    if located is None:
        return None
    index, parts = located
    try:
        parent, chain = _walk_to(guard.fds[index], parts)
    except OSError:
        # A directory on the way is missing: it is watched as absent (a created one is seen).
        return _Watched(index, parts, (), Entry("absent"), grows)
    try:
        entry = capture(parent, parts[-1], budget, deep=deep)
        if grows and entry.kind == "file":
            entry = entry._replace(digest=_tail_digest(parent, parts[-1], entry.size))
    finally:
        os.close(parent)
    return _Watched(index, parts, tuple(chain), entry, grows)


def capture(
    parent: int, name: str, budget: _Budget | None = None, *, copy: bool = True, deep: bool = True
) -> Entry:
    """What `name` in the directory `parent` is now (never following a symlink).

    A directory's entries are captured too unless not `deep`.
    """
    budget = budget or _Budget()
    try:
        st = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except FileNotFoundError:
        return Entry("absent")
    except NotADirectoryError:
        return Entry("absent")
    ident = (st.st_dev, st.st_ino, stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns)
    if stat.S_ISLNK(st.st_mode):
        return Entry("link", *ident, digest=os.readlink(name, dir_fd=parent))
    if stat.S_ISREG(st.st_mode):
        return _capture_file(parent, name, ident, budget, copy)
    if stat.S_ISDIR(st.st_mode):
        kids = _children(parent, name, budget, 0, [0]) if deep else None
        return Entry("dir", *ident, children=kids)
    return Entry("other", *ident)


def _capture_file(
    parent: int, name: str, ident: tuple[int, int, int, int, int], budget: _Budget, copy: bool
) -> Entry:
    import hashlib

    digest = hashlib.sha256()
    keep = copy and ident[3] <= FILE_COPY_MAX and budget.copied + ident[3] <= COPY_TOTAL_MAX
    chunks: list[bytes] = []
    try:
        fd = os.open(name, _READ, dir_fd=parent)
    except OSError:
        return Entry("other", *ident)
    try:
        while data := os.read(fd, 1 << 16):
            digest.update(data)
            if keep:
                chunks.append(data)
    finally:
        os.close(fd)
    data_kept = b"".join(chunks) if keep else None
    if data_kept is not None:
        budget.copied += len(data_kept)
    return Entry("file", *ident, digest=digest.hexdigest(), data=data_kept)


def _children(
    parent: int, name: str, budget: _Budget, depth: int, seen: list[int]
) -> tuple[tuple[str, Entry], ...] | None:
    if depth >= TREE_MAX_DEPTH:
        return None
    try:
        fd = os.open(name, _DIR, dir_fd=parent)
    except OSError:
        return None
    try:
        names = sorted(os.listdir(fd))
        seen[0] += len(names)
        if seen[0] > TREE_MAX_ENTRIES:
            return None
        found: list[tuple[str, Entry]] = []
        for child in names:
            entry = capture(fd, child, budget, deep=False)
            if entry.kind == "dir":
                kids = _children(fd, child, budget, depth + 1, seen)
                entry = entry._replace(children=kids)
            found.append((child, entry))
        return tuple(found)
    finally:
        os.close(fd)


def _module_control(guard: Guard, gitdir: str) -> list[str]:
    """The control files of each submodule's git directory (.git/modules/NAME)."""
    located = _locate(guard, os.path.join(gitdir, "modules", "x"))
    if located is None:
        return []
    index, parts = located
    try:
        fd, _ = _walk_to(guard.fds[index], parts)
    except OSError:
        return []
    try:
        names = sorted(os.listdir(fd))[:TREE_MAX_ENTRIES]
    finally:
        os.close(fd)
    base = os.path.join(gitdir, "modules")
    return [os.path.join(base, n, c) for n in names for c in GIT_CONTROL]


# -- the search for .git entries ------------------------------------------------------------


def _find_gits(guard: Guard, workspace: str, held: int) -> dict[str, tuple[int, int]]:
    """Every `.git` entry below the workspace held by `held` (its own included).

    rel path -> (dev, ino); bounded by WALK_MAX_DIRS (a cut is recorded in guard.walk_cut).
    """
    found: dict[str, tuple[int, int]] = {}
    top = os.dup(held)
    pending: list[tuple[int, str]] = [(top, "")]
    visited = 0
    try:
        while pending:
            fd, rel = pending.pop()
            visited += 1
            if visited > WALK_MAX_DIRS:
                os.close(fd)
                guard.walk_cut.append(workspace)
                break
            try:
                _scan(fd, rel, found, pending)
            finally:
                os.close(fd)
    finally:
        for fd, _ in pending:
            os.close(fd)
    return found


def _scan(
    fd: int, rel: str, found: dict[str, tuple[int, int]], pending: list[tuple[int, str]]
) -> None:
    with os.scandir(fd) as entries:
        for entry in entries:
            path = f"{rel}/{entry.name}" if rel else entry.name
            if entry.name == GIT:
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    found[path] = (st.st_dev, st.st_ino)
                continue  # git's own directory: nothing below it is a repository of its own
            if entry.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    pending.append((os.open(entry.name, _DIR, dir_fd=fd), path))


# -- after the run ---------------------------------------------------------------------------


def settle(guard: Guard) -> list[str]:
    """After the run, once: judge every watched path and put it right; the lines said.

    Empty when the command left every host-trusted path as it was; `guard.acted` tells
    whether anything was moved or put back.
    """
    if guard.settled:
        return guard.lines
    guard.settled = True
    try:
        for workspace, before in zip(guard.workspaces, guard.gits, strict=True):
            _settle_gits(guard, workspace, before)
        for watched in guard.watched:
            _settle_one(guard, watched)
        for workspace in dict.fromkeys(guard.walk_cut):
            _say(
                guard,
                f"the search for .git entries below {workspace} stopped after {WALK_MAX_DIRS} "
                "directories: a repository the command made deeper was not looked for",
            )
    finally:
        guard.close()
    return guard.lines


def _say(guard: Guard, line: str, *, acted: bool = False) -> None:
    if line not in guard.lines:
        guard.lines.append(line)
    guard.acted = guard.acted or acted


def _settle_gits(guard: Guard, workspace: str, before: dict[str, tuple[int, int]]) -> None:
    index = guard.roots.index(workspace) if workspace in guard.roots else -1
    if index < 0 or guard.fds[index] < 0:
        return
    after = _find_gits(guard, workspace, guard.fds[index])
    for rel, ident in sorted(after.items()):
        if before.get(rel) == ident:
            continue
        parts = tuple(rel.split("/"))
        shown = os.path.join(workspace, rel)
        try:
            parent, _ = _walk_to(guard.fds[index], parts)
        except OSError:
            continue  # gone since the search (nothing of the child's runs now)
        try:
            dest = _move_aside(guard, parent, parts[-1], shown)
        finally:
            os.close(parent)
        _say(
            guard,
            f"the command made {shown}, a git repository's entry the host would trust (its "
            f"config and hooks run code at your next git command there): moved aside to {dest}"
            f"{_keep(dest, shown)}",
            acted=True,
        )


def _settle_one(guard: Guard, watched: _Watched) -> None:
    shown = os.path.join(guard.roots[watched.root], *watched.parts)
    parent = _reach(guard, watched)
    if parent is None:
        return
    try:
        name = watched.parts[-1]
        before = watched.before
        shallow = before.kind == "dir" and before.children is None
        after = capture(parent, name, copy=False, deep=not shallow)
        if watched.grows and _grown(parent, name, before, after):
            return
        if not watched.grows and (before.same(after) or before.kind == after.kind == "absent"):
            return
        _put_right(guard, parent, name, shown=shown, before=before, after=after)
    finally:
        os.close(parent)


def _grown(parent: int, name: str, before: Entry, after: Entry) -> bool:
    """A file the host appends to: the same inode, no shorter, the old end still there."""
    if before.kind != after.kind:
        return False
    if before.kind != "file":
        return before.same(after)
    if (after.dev, after.ino) != (before.dev, before.ino) or after.size < before.size:
        return False
    return _tail_digest(parent, name, before.size) == before.digest


def _put_right(
    guard: Guard, parent: int, name: str, *, shown: str, before: Entry, after: Entry
) -> None:
    dest = ""
    if after.kind != "absent":
        dest = _move_aside(guard, parent, name, shown)
    if before.kind == "absent":
        what = "made"
        done = f"moved aside to {dest}{_keep(dest, shown)}"
    elif before.complete():
        _restore(parent, name, before)
        what = "removed" if after.kind == "absent" else "changed"
        done = "put back the copy taken before the run"
        if dest:
            done += f"; its version is at {dest}"
    else:
        what = "removed" if after.kind == "absent" else "changed"
        done = "no copy could be kept (larger than the bound), so it is not put back"
        if dest:
            done += f"; its version was moved aside to {dest}"
    _say(guard, f"the command {what} {shown}, which the host trusts: {done}", acted=True)


def _keep(dest: str, shown: str) -> str:
    """How to take a moved-aside entry back on purpose."""
    import shlex

    return f" (to use it after all: mv {shlex.quote(dest)} {shlex.quote(shown)})"


def _reach(guard: Guard, watched: _Watched) -> int | None:
    """A descriptor on the watched path's parent, directories swapped since put back first.

    None when the parent does not exist (nor did it, or the original is gone: said).
    """
    fd = os.dup(guard.fds[watched.root])
    root = guard.roots[watched.root]
    for depth, part in enumerate(watched.parts[:-1]):
        expected = watched.chain[depth] if depth < len(watched.chain) else None
        try:
            nxt = os.open(part, _DIR, dir_fd=fd)
        except OSError:
            nxt = -1
        if expected is not None and (nxt < 0 or _ident(nxt) != expected):
            if nxt >= 0:
                os.close(nxt)
            shown = os.path.join(root, *watched.parts[: depth + 1])
            nxt = _repair_dir(guard, fd, part, expected, shown)
        os.close(fd)
        if nxt < 0:
            return None
        fd = nxt
    return fd


def _ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _repair_dir(guard: Guard, parent: int, name: str, expected: tuple[int, int], shown: str) -> int:
    """`name` in `parent` is not the directory it was: move it aside, find the original."""
    dest = ""
    if capture(parent, name, copy=False, deep=False).kind != "absent":
        dest = _move_aside(guard, parent, name, shown)
    found = _find_by_ident(parent, expected)
    what = f"the command replaced {shown}, a directory above host-trusted paths"
    if dest:
        what += f" (its version was moved aside to {dest})"
    if found is None:
        _say(guard, f"{what}; the original was not found beside it", acted=True)
        return -1
    os.rename(found, name, src_dir_fd=parent, dst_dir_fd=parent)
    _say(guard, f"{what}: the original, found as {found}, was put back", acted=True)
    try:
        return os.open(name, _DIR, dir_fd=parent)
    except OSError:
        return -1


def _find_by_ident(parent: int, expected: tuple[int, int]) -> str | None:
    with os.scandir(parent) as entries:
        for count, entry in enumerate(entries):
            if count >= TREE_MAX_ENTRIES:
                return None
            with contextlib.suppress(OSError):
                st = entry.stat(follow_symlinks=False)
                if (st.st_dev, st.st_ino) == expected and stat.S_ISDIR(st.st_mode):
                    return entry.name
    return None


def _move_aside(guard: Guard, parent: int, name: str, shown: str) -> str:
    """Move `name` into this run's held directory (or, elsewhere, to an inert name beside it).

    Returns where it went. Nothing is deleted.
    """
    guard.moved += 1
    held = _held_dir(guard)
    if held is not None:
        dest = f"{guard.moved:03d}-{name}"
        try:
            os.rename(name, dest, src_dir_fd=parent, dst_dir_fd=held)
        except OSError as exc:
            if exc.errno != errno.EXDEV:
                raise
        else:
            _note(held, dest, shown)
            return os.path.join(guard.held_path, dest)
    # Another file system than the state directory's: a name no tool trusts, beside it.
    inert = f"{name}.egressbox-held-{guard.stamp}-{guard.moved}"
    os.rename(name, inert, src_dir_fd=parent, dst_dir_fd=parent)
    return os.path.join(os.path.dirname(shown), inert)


def _held_dir(guard: Guard) -> int | None:
    if guard.held_fd is not None or guard.state is None:
        return guard.held_fd
    name = f"{guard.stamp}-{os.getpid()}"
    try:
        os.mkdir(name, 0o700, dir_fd=guard.state)
        guard.held_fd = os.open(name, _DIR, dir_fd=guard.state)
    except OSError:
        guard.state = None  # unusable: fall back to inert names in place
        return None
    guard.held_path = os.path.join(guard.state_path, name)
    return guard.held_fd


def _note(held: int, dest: str, shown: str) -> None:
    """One line per entry in the held directory's MANIFEST: where it was."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC
    with contextlib.suppress(OSError):
        fd = os.open("MANIFEST", flags, 0o600, dir_fd=held)
        try:
            os.write(fd, f"{dest}\t{shown}\n".encode())
        finally:
            os.close(fd)


def _restore(parent: int, name: str, entry: Entry) -> None:
    """Recreate `entry` as `name` in `parent` (a fresh name first, then renamed into place)."""
    temp = f".egressbox-restore-{os.getpid()}-{time.monotonic_ns()}"
    _make(parent, temp, entry)
    os.rename(temp, name, src_dir_fd=parent, dst_dir_fd=parent)


def _make(parent: int, name: str, entry: Entry) -> None:
    if entry.kind == "link":
        os.symlink(entry.digest, name, dir_fd=parent)
        return
    if entry.kind == "dir":
        os.mkdir(name, 0o700, dir_fd=parent)
        fd = os.open(name, _DIR, dir_fd=parent)
        try:
            for child, sub in entry.children or ():
                _make(fd, child, sub)
            os.fchmod(fd, entry.mode)
        finally:
            os.close(fd)
        return
    assert entry.data is not None
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(name, flags, 0o600, dir_fd=parent)
    try:
        view = memoryview(entry.data)
        while view:
            view = view[os.write(fd, view) :]
        os.fchmod(fd, entry.mode)
        os.utime(fd, ns=(entry.mtime_ns, entry.mtime_ns))
    finally:
        os.close(fd)


def _tail_digest(parent: int, name: str, size: int) -> str:
    """sha256 of the last TAIL_BYTES before `size` (what an appended file keeps unchanged)."""
    import hashlib

    digest = hashlib.sha256()
    try:
        fd = os.open(name, _READ, dir_fd=parent)
    except OSError:
        return ""
    try:
        start = max(0, size - TAIL_BYTES)
        digest.update(os.pread(fd, size - start, start))
    finally:
        os.close(fd)
    return digest.hexdigest()
