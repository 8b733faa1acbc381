"""Where a run's workspace is, and what its git repository keeps outside it.

- The project root: the nearest directory at or above the working directory that holds a
  `.git` entry (a directory, or a file naming the git directory) or an `egressbox.toml`, like
  Harn's manifest root; without one, the working directory. Only markers of the invoking
  user count (git's `safe.directory` rule: a `.git` someone else planted in `/tmp` must not
  make all of `/tmp` the workspace). A submodule's `.git` file leads on to its superproject.
- The git directories of a workspace that live outside it: a linked worktree's own git
  directory and the repository's common directory (read+write: `git commit` writes objects,
  refs and logs there), and the object stores named by `objects/info/alternates` (read-only:
  git only reads them). Every one is checked against git's own layout before it is granted,
  and the files that name them are host-trusted (read-only in the view), so no command can
  point the next run's grants elsewhere.
- The project's `egressbox.toml` as the policy when `--policy` is not given, used only once the
  user has run with it explicitly (`--policy FILE` records its hash where no child can write):
  a cloned repository, or a command run earlier, could have written it.

Reads the host (lstat, small files) and egressbox's own cache; changes nothing but that cache.
"""

from __future__ import annotations

import contextlib
import os
import stat
from typing import NamedTuple

PROJECT_POLICY = "egressbox.toml"
GIT = ".git"
MARKERS = (GIT, PROJECT_POLICY)
# Small files read while finding git directories (a .git file, commondir, alternates).
MAX_GIT_FILE = 64 * 1024
# git follows alternates of alternates up to this depth (its own limit).
MAX_ALTERNATE_DEPTH = 5
TRUST_FILE = "trusted-policies.json"
MAX_TRUSTED = 256  # policy files remembered; the oldest go first


class ProjectRoot(NamedTuple):
    """The default workspace and why it was chosen."""

    path: str
    marker: str = ""  # ".git" or "egressbox.toml"; "" when none was found
    passed_over: tuple[str, ...] = ()  # markers not taken (another user's)

    @property
    def reason(self) -> str:
        if self.marker:
            return f"the project root: it holds {self.marker}"
        why = "no .git or egressbox.toml of yours at or above it"
        return f"the working directory ({why})"

    @property
    def policy(self) -> str | None:
        """The project's egressbox.toml, when it is a regular file of the invoker's."""
        path = os.path.join(self.path, PROJECT_POLICY)
        return path if _owned(path, regular=True) else None


def find_project_root(cwd: str) -> ProjectRoot:
    """The nearest enclosing project root of `cwd` (a real path), else `cwd` itself."""
    passed: list[str] = []
    current = cwd
    while True:
        for marker in MARKERS:
            path = os.path.join(current, marker)
            if not os.path.lexists(path):
                continue
            if not (_owned(current) and _owned(path)):
                passed.append(path)
                continue
            if marker == GIT and _submodule_of_ancestor(current, path):
                continue
            return ProjectRoot(current, marker, tuple(passed))
        parent = os.path.dirname(current)
        if parent == current:
            return ProjectRoot(cwd, "", tuple(passed))
        current = parent


def _owned(path: str, *, regular: bool = False) -> bool:
    try:
        st = os.lstat(path)
    except OSError:
        return False
    if regular and not stat.S_ISREG(st.st_mode):
        return False
    return st.st_uid == os.geteuid() and not stat.S_ISLNK(st.st_mode)


def _submodule_of_ancestor(directory: str, dotgit: str) -> bool:
    """A `.git` file naming a git directory under an ancestor's `.git/modules/`."""
    target = _gitfile_target(directory, dotgit)
    if target is None:
        return False
    head, sep, _ = target.partition("/.git/modules/")
    return bool(sep) and directory.startswith(head.rstrip("/") + "/")


def _read_small(path: str) -> str | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, MAX_GIT_FILE).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _gitfile_target(directory: str, dotgit: str) -> str | None:
    """The git directory a `.git` file names (`gitdir: PATH`), as a real path."""
    try:
        if not stat.S_ISREG(os.lstat(dotgit).st_mode):
            return None
    except OSError:
        return None
    text = _read_small(dotgit) or ""
    first = text.splitlines()[0] if text else ""
    if not first.startswith("gitdir:"):
        return None
    named = first[len("gitdir:") :].strip()
    return os.path.realpath(os.path.join(directory, named)) if named else None


# -- a workspace's git directories --------------------------------------------------------


class GitGrants(NamedTuple):
    """What a workspace's repository needs outside it, and what stays host-trusted."""

    write: tuple[tuple[str, str], ...] = ()  # (path, why)
    read: tuple[tuple[str, str], ...] = ()  # (path, why)
    protect: tuple[str, ...] = ()  # read-only in the view: they decide the next run's grants
    notes: tuple[str, ...] = ()  # what was found but not granted, and why


def git_grants(root: str) -> GitGrants:
    """The git directories of the workspace `root` (a real path) that lie outside it."""
    dotgit = os.path.join(root, GIT)
    try:
        st = os.lstat(dotgit)
    except OSError:
        return GitGrants()
    if stat.S_ISDIR(st.st_mode):
        read, notes = _alternates(os.path.join(dotgit, "objects"), root)
        alternates = os.path.join(dotgit, "objects", "info", "alternates")
        return GitGrants(read=read, protect=(alternates,), notes=notes)
    if stat.S_ISREG(st.st_mode):
        return _linked(root, dotgit)
    return GitGrants()


def _linked(root: str, dotgit: str) -> GitGrants:
    gitdir = _gitfile_target(root, dotgit)
    if gitdir is None:
        return GitGrants(notes=(f"{dotgit} names no git directory",))
    common = _common_dir(gitdir)
    if common is None:
        why = f"{gitdir} is not a linked worktree's git directory of yours whose repository is too"
        return GitGrants(protect=(dotgit,), notes=(why,))
    if not _points_back(gitdir, dotgit):
        why = f"{gitdir}/gitdir does not name {dotgit}: not granted"
        return GitGrants(protect=(dotgit,), notes=(why,))
    protect = [
        dotgit,
        os.path.join(gitdir, "commondir"),
        os.path.join(gitdir, "gitdir"),
        os.path.join(gitdir, "config.worktree"),
        os.path.join(common, "config"),
        os.path.join(common, "hooks"),
        os.path.join(common, "objects", "info", "alternates"),
        *_module_files(common),
    ]
    write: list[tuple[str, str]] = []
    if not _inside(common, root):
        write.append((common, f"the git common directory of the worktree {root}"))
    if not _inside(gitdir, common) and not _inside(gitdir, root):
        write.append((gitdir, f"the git directory of the worktree {root}"))
    read, notes = _alternates(os.path.join(common, "objects"), root)
    return GitGrants(tuple(write), read, tuple(protect), notes)


def _common_dir(gitdir: str) -> str | None:
    """A linked worktree's repository: `gitdir` is COMMON/worktrees/NAME, both the invoker's."""
    named = (_read_small(os.path.join(gitdir, "commondir")) or "").strip()
    if not named:
        return None
    common = os.path.realpath(os.path.join(gitdir, named))
    layout = os.path.dirname(gitdir) == os.path.join(common, "worktrees")
    if not layout or not (_owned(gitdir) and _owned(common)):
        return None
    if not _is_git_dir(common) or not os.path.lexists(os.path.join(gitdir, "HEAD")):
        return None
    return common


def _points_back(gitdir: str, dotgit: str) -> bool:
    """git writes the worktree's `.git` file path into GITDIR/gitdir."""
    named = (_read_small(os.path.join(gitdir, "gitdir")) or "").strip()
    return bool(named) and os.path.realpath(os.path.join(gitdir, named)) == dotgit


def _is_git_dir(path: str) -> bool:
    return all(
        os.path.isdir(os.path.join(path, name)) for name in ("objects", "refs")
    ) and os.path.lexists(os.path.join(path, "HEAD"))


def _module_files(common: str) -> list[str]:
    modules = os.path.join(common, "modules")
    try:
        names = sorted(os.listdir(modules))
    except OSError:
        return []
    return [os.path.join(modules, n, f) for n in names for f in ("hooks", "config")]


def _alternates(objects: str, root: str) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """Object stores borrowed through `objects/info/alternates`, recursively (read-only)."""
    found: dict[str, str] = {}
    notes: list[str] = []
    pending = [(objects, 0)]
    while pending:
        current, depth = pending.pop()
        if depth >= MAX_ALTERNATE_DEPTH:
            continue
        text = _read_small(os.path.join(current, "info", "alternates")) or ""
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            store = os.path.realpath(os.path.join(current, line))
            if store in found or _inside(store, root):
                continue
            if not _object_store(store):
                notes.append(f"alternate {store} is not an object store of yours: not granted")
                continue
            found[store] = f"git alternates of {root}"
            pending.append((store, depth + 1))
    return tuple(found.items()), tuple(notes)


def _object_store(path: str) -> bool:
    """A repository's `objects` directory of the invoker's (git names alternates so)."""
    if os.path.basename(path) != "objects" or not _owned(path):
        return False
    parent = os.path.dirname(path)
    return os.path.lexists(os.path.join(parent, "HEAD")) and os.path.isdir(parent)


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


# -- the project's policy file, trusted once used explicitly ------------------------------


def _digest(path: str) -> str | None:
    import hashlib  # only for a project policy: loading it costs ~5 ms of every run's start

    data = _read_small_bytes(path)
    return hashlib.sha256(data).hexdigest() if data is not None else None


def _read_small_bytes(path: str) -> bytes | None:
    try:
        with open(path, "rb") as handle:
            return handle.read(1 << 20)
    except OSError:
        return None


def _trust_path() -> str:
    from egressbox.runner import own_state

    return own_state.path(TRUST_FILE)


def _trusted() -> dict[str, str]:
    import json

    from egressbox.runner import own_state

    with contextlib.suppress(ValueError, TypeError):
        data = json.loads(own_state.read(_trust_path()) or b"{}")
        if isinstance(data, dict):
            return {str(k): str(v) for k, v in data.items()}
    return {}


def is_trusted(path: str) -> bool:
    """This version of the policy file was used explicitly (--policy) before."""
    real = os.path.realpath(path)
    digest = _digest(real)
    return digest is not None and _trusted().get(real) == digest


def remember(path: str) -> None:
    """Trust this version of a project policy file for runs without --policy."""
    import json

    from egressbox.runner import own_state

    real = os.path.realpath(path)
    digest = _digest(real)
    if digest is None:
        return
    known = _trusted()
    if known.get(real) == digest:
        return
    known.pop(real, None)
    known[real] = digest
    kept = dict(list(known.items())[-MAX_TRUSTED:])
    own_state.write(_trust_path(), json.dumps(kept).encode())
