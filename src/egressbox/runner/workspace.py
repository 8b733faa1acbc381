"""A run's workspace: which directories it is, whether it may be written, what its git
repository and its toolchains need beyond it, and the line that announces each addition.

Decided before the fork from the options and the host's paths (runner/project.py); nothing is
made or changed on the host here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from egressbox.confine.grants import expand_user, is_under
from egressbox.confine.toolchains import MISSING
from egressbox.runner.options import RunRefusedError
from egressbox.runner.project import GitGrants, ProjectRoot, find_project_root, git_grants

# With a read-only workspace the scratch space (TMPDIR, caches) lives in the child's private
# /tmp: it exists for the run only, and nothing of the project is written.
READ_ONLY_SCRATCH = "/tmp/egressbox-scratch"
ANNOUNCE = "sandbox active; "


# Mutable state of one run, compared by identity. A plain class, not a dataclass: the
# decorator compiles its __init__ at import, on the start-up path.
class Layout:
    """The workspace roots and what they bring with them."""

    def __init__(
        self,
        workspaces: tuple[str, ...],
        *,
        read_only: bool = False,
        project: ProjectRoot | None = None,
    ) -> None:
        self.workspaces = workspaces
        self.read_only = read_only
        self.project = project  # set when the default (project root) was taken
        self.git_write: tuple[tuple[str, str], ...] = ()  # (path, why)
        self.git_read: tuple[tuple[str, str], ...] = ()
        self.protect: tuple[str, ...] = ()  # host-trusted git files (read-only in the view)
        self.notes: list[str] = []

    @property
    def writable(self) -> tuple[str, ...]:
        """Workspace roots and git directories the child may write."""
        if self.read_only:
            return ()
        return (*self.workspaces, *(p for p, _ in self.git_write))

    @property
    def readable(self) -> tuple[str, ...]:
        """What is granted read-only: git alternates, and everything when read-only."""
        ro = (*self.workspaces, *(p for p, _ in self.git_write)) if self.read_only else ()
        return (*ro, *(p for p, _ in self.git_read))


def lay_out(
    write_roots: tuple[str, ...],
    *,
    cwd: str,
    home: str,
    read_only: bool,
    git: bool,
) -> Layout:
    """The workspaces: `write_roots` (real paths), else the project root above `cwd`."""
    project = None
    if not write_roots:
        project = find_project_root(cwd)
        refuse_wide_workspace(project, home, cwd)
        write_roots = (project.path,)
    layout = Layout(write_roots, read_only=read_only, project=project)
    if git:
        _add_git(layout)
    return layout


def _add_git(layout: Layout) -> None:
    merged = GitGrants()
    for root in layout.workspaces:
        found = git_grants(root)
        merged = GitGrants(
            (*merged.write, *found.write),
            (*merged.read, *found.read),
            (*merged.protect, *found.protect),
            (*merged.notes, *found.notes),
        )
    inside = layout.workspaces
    layout.git_write = tuple(
        (p, why) for p, why in dict(merged.write).items() if not _under_any(p, inside)
    )
    layout.git_read = tuple(
        (p, why) for p, why in dict(merged.read).items() if not _under_any(p, inside)
    )
    layout.protect = tuple(dict.fromkeys(merged.protect))
    layout.notes += list(merged.notes)


def refuse_wide_workspace(project: ProjectRoot, home: str, cwd: str) -> None:
    """A default workspace that is `/` or the home directory itself must be named."""
    wide = {"/", os.path.realpath(home)} if home else {"/"}
    path = project.path
    if path not in wide:
        return
    what = "the whole file system" if path == "/" else "your whole home directory"
    found = f" (the project root: it holds {project.marker})" if project.marker else ""
    narrower = f", --write-root {cwd} for the current directory only" if cwd != path else ""
    raise RunRefusedError(
        [],
        message=f"the workspace would be {path}{found}, {what}: every file there would be "
        f"writable by the command; run it from a project directory, or pass --write-root "
        f"{path} to mean it{narrower}",
        cause="workspace_too_wide",
    )


def refuse_cwd_outside(
    cwd: str, roots: Sequence[str], hidden: Sequence[str], project: ProjectRoot | None
) -> None:
    """The working directory must exist in the child's view: inside a granted root."""
    if any(is_under(cwd, root) for root in roots) and not _under_any(cwd, hidden):
        return
    admit = f"--write-root {cwd} (or --read-root {cwd})"
    if project is None:
        found = find_project_root(cwd)
        if found.marker:
            admit = f"--write-root {found.path} (its project root: it holds {found.marker})"
    raise RunRefusedError(
        [],
        message=f"refused: the working directory {cwd} is outside every root, so it would not "
        f"exist for the command; run from inside a root, or add {admit}",
        cause="cwd_unavailable",
    )


def refuse_private_roots(roots: Sequence[str], cwd: str) -> None:
    """A root (or the working directory) that is a directory the command gets privately would
    be shadowed: the command would see an empty file system made for the run there, and what
    it wrote would never reach the host. Refused with the reason, never run as if granted.

    The world (confine/world.py) binds grants below /tmp, /var/tmp and /run from the host; it
    makes those three themselves, and everything under /dev, /proc and /sys, afresh.
    """
    from egressbox.confine.world import CONSTRUCTED, PRIVATE_TMPFS

    for path in (*roots, cwd):
        real = os.path.realpath(path)
        if real in PRIVATE_TMPFS or _under_any(real, CONSTRUCTED):
            what = "the working directory" if path == cwd and path not in roots else "the root"
            raise RunRefusedError(
                [],
                message=f"refused: {what} {path} is a directory the command gets privately (an "
                "empty file system made for the run): it would not see the host's files there, "
                "and nothing it wrote there would reach the host; run from a directory below it "
                "(such as /tmp/work) or grant another one with --write-root",
                cause="private_directory",
            )


def _under_any(path: str, roots: Sequence[str]) -> bool:
    return any(is_under(path, root) for root in roots)


# -- real toolchain caches -----------------------------------------------------------------


def cache_check(home: str, denied: Sequence[str]) -> Callable[[str], str]:
    """Why `--toolchain-cache real` may not grant a path ("" when it may).

    Only an existing directory, by its own name: not the home directory or one above it,
    nothing on the credential deny list, and never through a symlink (a command that could
    write an earlier real cache could have replaced it with a link to ~/bin). Nothing is made
    in the home directory: a cache that does not exist yet stays in the scratch space.
    """
    real_home = os.path.realpath(home) if home else ""

    def check(path: str) -> str:
        if not os.path.isabs(path):
            return "not an absolute path"
        if path == "/" or (real_home and is_under(real_home, path)):
            return "it holds the home directory"
        if _under_any(path, denied) or any(is_under(d, path) for d in denied):
            return "the credential deny list covers it"
        if not os.path.lexists(path):
            return MISSING
        if os.path.realpath(path) != path or not os.path.isdir(path):
            return "a symlink is on its way, or it is no directory"
        return ""

    return check


# -- announcements ---------------------------------------------------------------------------


def announce_lines(
    *,
    write: Sequence[tuple[str, str]],
    read: Sequence[tuple[str, str]],
    sockets: Sequence[str],
    unconfined_files: bool,
) -> list[str]:
    """One line per root added beyond the workspace, as Harn prints them."""
    suffix = (
        "; profile unrestricted applies no filesystem rules: every path you may use, the "
        "command may too"
        if unconfined_files
        else ""
    )
    lines = [f"{ANNOUNCE}extra write root: {p}{_why(w)}{suffix}" for p, w in write]
    lines += [f"{ANNOUNCE}extra read root: {p}{_why(w)}{suffix}" for p, w in read]
    lines += [f"{ANNOUNCE}extra unix socket root: {p}{suffix}" for p in sockets]
    return list(dict.fromkeys(lines))


def _why(why: str) -> str:
    return f" ({why})" if why else ""


def expand(paths: Sequence[str], home: str) -> tuple[str, ...]:
    return tuple(os.path.realpath(expand_user(p, home)) for p in paths)
