"""Which boundary refused a failing command, judged from its own error output (sans-IO).

The kernel offers an unprivileged supervisor no denial events (no audit log,
no tracefs, no BPF), so the witness is the command itself: programs that fail
on a file or socket nearly always print the errno text with the path
(`cat: /x: Permission denied`, `PermissionError: [Errno 13] Permission
denied: '/x'`, Go's `open /x: permission denied`). This module scans the tail
of that output for such lines, pulls the paths out, and judges each path
against the run's confinement plan:

- a path on the credential read-deny list (that exists on the host) -> `home_read`;
- a read refused under a home directory that the plan does not make readable -> `home_read`;
- a read refused elsewhere outside the read roots (the path exists on the host) -> `read`;
- a write (EROFS, a write verb, a file being created, or a refusal of a path the
  plan lets the command read) where the plan does not allow writing -> `write`;
- a unix socket of the host that the plan hides, or an abstract socket name
  (another network namespace) -> `local_socket`;
- any of these on a toolchain's cache (the caller's GOMODCACHE, npm's ~/.npm...: the plan's
  `caches`, from confine/toolchains.py) -> `toolchain_cache`, naming the variable.

A command killed by SIGSYS met the seccomp filter (`seccomp`); the kernel's audit record of
the kill, when the caller can read it, names the system call (`seccomp_kills`). A namespace
refused with EPERM (`unshare: unshare failed: Operation not permitted`) under the filter is
`seccomp` too.

Evidence only: a path missing on the host as well is "not found", the command's own business,
never blamed on a boundary; a failure that shows no refusal gets no record at all (`run` then
reports the exit status and nothing else). A hint names exactly the path refused (its
directory only when the path is to be created), never `/`, a home directory or one of its
parents: granting those would open far more than the command asked for.

A path the plan grants is the command's own business and is never blamed on
a boundary. What the host's filesystem says about a path (exists, socket,
directory) comes from the caller through `lookup`: no I/O happens here.
"""

from __future__ import annotations

import functools
import posixpath
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import TYPE_CHECKING

from egressbox.confine.grants import is_under
from egressbox.confine.toolchains import CacheMode, CacheRoot, cache_hint, innermost

if TYPE_CHECKING:
    import re


class Boundary(StrEnum):
    EGRESS = "egress"
    LOCAL_SOCKET = "local_socket"
    HOME_READ = "home_read"
    READ = "read"  # outside the read roots, not under a home directory
    WRITE = "write"
    TOOLCHAIN_CACHE = "toolchain_cache"
    SECCOMP = "seccomp"
    TIMEOUT = "timeout"
    UNKNOWN = "unknown"


# How much of the command's error output is kept and scanned: the fatal error
# is nearly always at the end, and a bound keeps memory and scanning time fixed.
TAIL_BYTES = 64 * 1024
# Longest line scanned (a minified stack trace can be one huge line).
MAX_LINE = 4096
# Distinct paths judged per run (each costs the caller a stat).
MAX_PATHS = 32
# Paths named in the one-line summary; the record keeps them all.
LINE_PATHS = 3
SOURCE_OUTPUT = "from the command's error output"
SOURCE_AUDIT = "from the proxy's audit records"

# strerror texts (glibc, Python, Rust) and Go/Node's lower-case forms, matched
# case-insensitively, and errno names as Node prints them.
ERRNO_TEXTS: dict[str, str] = {
    "permission denied": "EACCES",
    "read-only file system": "EROFS",
    "operation not permitted": "EPERM",
    "no such file or directory": "ENOENT",
    "connection refused": "ECONNREFUSED",
}
ERRNO_NAMES = frozenset(ERRNO_TEXTS.values())


@functools.cache
def _patterns() -> _Patterns:
    """Compiled once, on the first failing run (compiling costs milliseconds at start-up)."""
    import re

    errno_words = "|".join(re.escape(t) for t in ERRNO_TEXTS)
    names = "|".join(sorted(ERRNO_NAMES))
    return _Patterns(
        errno=re.compile(rf"{errno_words}|\b(?:{names})\b", re.IGNORECASE),
        # Verbs that make a refusal a write (coreutils, git, Python, npm, pip wording).
        write_verb=re.compile(
            r"\b(?:touch|creat\w*|writ(?:e|es|ing|able)|mkdir|mkstemp|mkdtemp|remov\w*|renam\w*|"
            r"unlink\w*|lock\w*|sav(?:e|ing)|delet\w*|overwrit\w*|truncat\w*|append\w*|"
            r"mov(?:e|ing)|cop(?:y|ying)|chmod|chown|install\w*|symlink\w*|link)\b",
            re.IGNORECASE,
        ),
        # Terminal escape sequences (a pty makes colours likely): CSI, OSC, two-byte ones.
        escapes=re.compile(
            r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[@-Z\\-_]"
        ),
        # A quoted path: '...', "...", `...' and the typographic single and double quotes.
        quoted=re.compile(
            r"""'([^'\n]{1,1024})'|"([^"\n]{1,1024})"|`([^'`\n]{1,1024})'"""
            "|\u2018([^\u2019\n]{1,1024})\u2019|\u201c([^\u201d\n]{1,1024})\u201d"
        ),
        # A bare absolute or ~-relative path, not inside a URL or word.
        bare=re.compile(r"(?<![\w:/~.@-])(~?/[^\s'\"`,;()\[\]{}<>|]{0,1024})"),
        newline=re.compile(r"\r\n|\r|\n"),
        # A POSIX shell (dash, busybox) that could not find a program by its path:
        # `sh: 1: /opt/tool: not found`.
        shell_missing=re.compile(r":\s*not found\s*$", re.IGNORECASE),
        # A namespace refused: util-linux `unshare: unshare failed: Operation not permitted`,
        # Python's `PermissionError: [Errno 1] Operation not permitted` after os.unshare.
        namespace=re.compile(r"\b(?:unshare|setns|clone3?)\b.*operation not permitted", re.I),
    )


@dataclass(frozen=True)
class _Patterns:
    """The compiled patterns that read a refusal out of an error line."""

    errno: re.Pattern[str]
    write_verb: re.Pattern[str]
    escapes: re.Pattern[str]
    quoted: re.Pattern[str]
    bare: re.Pattern[str]
    newline: re.Pattern[str]
    shell_missing: re.Pattern[str]
    namespace: re.Pattern[str]


_TRAILING = ".:,;)]}'\""


@dataclass(frozen=True)
class ErrorLine:
    """One line of error output that carries an errno with at least one path."""

    errno: str  # EACCES, EROFS, EPERM, ENOENT or ECONNREFUSED
    paths: tuple[str, ...]  # as printed: absolute, ~/..., @abstract or \\x00abstract
    line: str
    writes: bool  # the wording says the command was writing
    relative: tuple[str, ...] = ()  # quoted relative paths (from the command's directory)


@dataclass(frozen=True)
class HostPath:
    """What the host's filesystem says about a path (the caller stats it, outside the sandbox)."""

    exists: bool
    is_socket: bool = False
    is_dir: bool = False
    parent_exists: bool = False
    readable: bool = True  # the caller itself may read it (plain permissions)


@dataclass(frozen=True)
class PathPlan:
    """The filesystem side of the confinement plan the launcher applied."""

    homes: tuple[str, ...] = ()
    read: tuple[str, ...] = ()
    write: tuple[str, ...] = ()
    deny: tuple[str, ...] = ()
    read_only: tuple[str, ...] = ()  # read-only roots nested in writable ones
    always_read_only: tuple[str, ...] = ()  # kernel interfaces remounted read-only
    hidden: tuple[str, ...] = ()  # behind a private tmpfs in the child's mount namespace
    bound_back: tuple[tuple[str, bool], ...] = ()  # (path, writable) under `hidden`, bound back
    landlock_fs: bool = False
    abstract_isolated: bool = False  # a network namespace or Landlock's abstract-socket scope
    # Toolchain cache locations outside the grants (confine/toolchains.py CachePlan.roots).
    caches: tuple[CacheRoot, ...] = ()
    cache_mode: CacheMode = CacheMode.SCRATCH
    cwd: str = ""  # the command's working directory: relative paths are judged from it
    read_only_workspaces: tuple[str, ...] = ()  # --read-only-workspace
    seccomp: bool = False  # the filter applied (it refuses new namespaces with EPERM)

    def denied(self, path: str) -> bool:
        return _under_any(path, self.deny)

    def visible(self, path: str) -> bool:
        return not _under_any(path, self.hidden) or self._binding(path) is not None

    def _binding(self, path: str) -> tuple[str, bool] | None:
        """The innermost bound-back path holding `path`."""
        found = [(root, w) for root, w in self.bound_back if is_under(path, root)]
        return max(found, key=lambda entry: len(entry[0])) if found else None

    def readable(self, path: str) -> bool:
        if self.denied(path) or not self.visible(path):
            return False
        return not self.landlock_fs or _under_any(path, (*self.read, *self.write))

    def writable(self, path: str) -> bool:
        if self.denied(path) or _under_any(path, (*self.read_only, *self.always_read_only)):
            return False
        binding = self._binding(path)
        if binding is not None and not binding[1]:
            return False  # bound back read-only into a hidden directory
        return not self.landlock_fs or _under_any(path, self.write)

    def under_home(self, path: str) -> bool:
        return any(h not in ("", "/") and is_under(path, h) for h in self.homes)


@dataclass(frozen=True)
class Finding:
    """One path the plan refused, with the error line that shows it."""

    boundary: Boundary  # UNKNOWN: refused by the plan, but by no named boundary
    path: str
    errno: str
    line: str
    hint: str
    variable: str = ""  # toolchain_cache: the cache variable


@dataclass(frozen=True)
class RefusalRecord:
    """Which boundary refused the child when it failed, and the evidence for it."""

    boundary: str  # a Boundary value: egress | local_socket | home_read | read | write | ...
    destinations: tuple[str, ...] = ()  # egress: host:port (reason) the proxy denied
    timeout: float | None = None  # boundary "timeout": the seconds that expired
    paths: tuple[str, ...] = ()  # local_socket, home_read, write, toolchain_cache: the paths
    source: str = ""  # where the evidence came from, e.g. SOURCE_OUTPUT
    hint: str = ""  # what would admit it
    evidence: tuple[str, ...] = ()  # the error lines the paths came from
    # Harn's fields: whether the mechanism behind the boundary is one the run's profile
    # requires ("profile") or applies best effort ("fallback"; "" for timeout and unknown),
    # and whether EGRESSBOX_SANDBOX was consulted for the profile (worktree only).
    requirement: str = ""
    selector_honored: bool = False
    variable: str = ""  # toolchain_cache: the cache variable (GOMODCACHE, npm_config_cache...)
    system_call: str = ""  # seccomp: the system call, when the kernel's record was readable

    @property
    def mechanism(self) -> str:
        """Harn's name for the field: the boundary that refused the command."""
        return self.boundary

    def line(self, code: int) -> str:
        if self.boundary == Boundary.TIMEOUT:
            return f"command exited {code}; the timeout of {self.timeout:g} s expired"
        if self.boundary == Boundary.UNKNOWN and self.paths:
            # Missing on the host too: not found, no boundary named.
            shown = ", ".join(self.paths[:LINE_PATHS])
            return f"command exited {code}; not found: {shown} ({self.hint})"
        if self.boundary == Boundary.UNKNOWN:
            # No boundary shown: say so, never "refused by" without evidence.
            tail = f" ({self.hint})" if self.hint else ""
            return (
                f"command exited {code}; egressbox cannot tell whether a boundary refused it{tail}"
            )
        named = self.paths or self.destinations or ((self.system_call,) if self.system_call else ())
        shown = ", ".join(named[:LINE_PATHS])
        if len(named) > LINE_PATHS:
            shown += f" and {len(named) - LINE_PATHS} more"
        where = f": {shown}" if shown else ""
        sourced = self.paths or self.system_call or self.boundary == Boundary.SECCOMP
        notes = "; ".join(n for n in (self.source if sourced else "", self.hint) if n)
        tail = f" ({notes})" if notes else ""
        return f"command exited {code}; refused by {self.boundary}{where}{tail}"


# -- scanning ------------------------------------------------------------------------------


def clean_lines(text: str) -> list[str]:
    """Lines of terminal output without escape sequences, each cut to MAX_LINE."""
    patterns = _patterns()
    plain = patterns.escapes.sub("", text)
    return [line[:MAX_LINE] for line in patterns.newline.split(plain)]


def error_lines(text: str) -> list[ErrorLine]:
    """Every line that carries an errno text together with a path, in order."""
    found = []
    for line in clean_lines(text):
        match = _patterns().errno.search(line)
        shell = _patterns().shell_missing.search(line) if match is None else None
        if match is None and shell is None:
            continue
        paths = extract_paths(line)
        relative = relative_paths(line)
        if shell is not None:  # only the program named last (`/bin/sh: 1: /opt/x: not found`)
            tail = line[: shell.start()].rsplit(": ", 1)[-1].strip()
            paths, relative = tuple(p for p in paths if p == tail), ()
        if not paths and not relative:
            continue
        word = match.group(0) if match is not None else "no such file or directory"
        errno = word.upper() if word.upper() in ERRNO_NAMES else ERRNO_TEXTS[word.lower()]
        writes = bool(_patterns().write_verb.search(line))
        found.append(ErrorLine(errno, paths, line, writes, relative))
    return found


def relative_paths(line: str) -> tuple[str, ...]:
    """Quoted relative paths (`touch: cannot touch 'target/x'`), judged from the command's
    working directory: a word without blanks, never a URL, an option or an errno name."""
    found = []
    for match in _patterns().quoted.finditer(line):
        text = next(g for g in match.groups() if g is not None).strip()
        if not text or text.startswith(("/", "~", "@", "-", "\\")) or "://" in text:
            continue
        if any(c.isspace() for c in text) or "\x00" in text or text.upper() in ERRNO_NAMES:
            continue
        found.append(text)
    return tuple(dict.fromkeys(found))


def extract_paths(line: str) -> tuple[str, ...]:
    """Quoted paths first, then bare absolute or ~-relative ones; in order, without repeats."""
    paths: list[str] = []
    spans: list[tuple[int, int]] = []
    for match in _patterns().quoted.finditer(line):
        text = next(g for g in match.groups() if g is not None)
        path = _quoted_path(text)
        if path is not None:
            paths.append(path)
            spans.append(match.span())
    for match in _patterns().bare.finditer(line):
        if any(start <= match.start() < end for start, end in spans):
            continue
        path = match.group(1).rstrip(_TRAILING)
        if _plausible(path):
            paths.append(path)
    return tuple(dict.fromkeys(paths))


def _quoted_path(text: str) -> str | None:
    text = text.strip()
    if text.startswith("\\x00") or text.startswith("\\0"):  # Python's repr of an abstract name
        name = text[4:] if text.startswith("\\x00") else text[2:]
        return "@" + name if name else None
    if text.startswith("@") and len(text) > 1 and not any(c.isspace() for c in text):
        return text
    return text if _plausible(text, spaces=True) else None


def _plausible(path: str, *, spaces: bool = False) -> bool:
    if path.startswith("~/"):
        path = path[1:]
    if not path.startswith("/") or path.startswith("//") or len(path) < 2:
        return False
    blank = any(c.isspace() and (c != " " or not spaces) for c in path)
    return "\x00" not in path and not blank


def _under_any(path: str, roots: Sequence[str]) -> bool:
    return any(is_under(path, root) for root in roots)


# -- judging -------------------------------------------------------------------------------


def normalize(path: str, home: str) -> str:
    """An absolute, normalized path (`~` expanded); abstract names are kept as `@name`."""
    if path.startswith("@"):
        return path
    if path == "~" or path.startswith("~/"):
        path = home + path[1:]
    return posixpath.normpath(path)


def judge(error: ErrorLine, path: str, host: HostPath, plan: PathPlan) -> Finding | None:
    """The boundary that refused `path` (already normalized), or None if the plan grants it."""
    if path.startswith("@") or host.is_socket:
        return _judge_socket(error, path, plan)
    if not path.startswith("/"):
        return None
    if plan.denied(path):
        # Missing on the host too: nothing was there to refuse.
        return _finding(error, path, Boundary.HOME_READ, _HINT_DENY) if host.exists else None
    if error.errno == "ENOENT":
        return _judge_missing(error, path, host, plan)
    if error.errno in {"EACCES", "EPERM", "EROFS"}:
        return _judge_refused(error, path, host, plan)
    return None


def _judge_socket(error: ErrorLine, path: str, plan: PathPlan) -> Finding | None:
    if path.startswith("@"):  # abstract names live in a network namespace
        abstract = plan.abstract_isolated and error.errno in {"ECONNREFUSED", "EPERM", "ENOENT"}
        return _finding(error, path, Boundary.LOCAL_SOCKET, _HINT_ABSTRACT) if abstract else None
    if plan.visible(path) and not plan.denied(path):
        return None  # reachable: a refused connection is the server's business
    hint = _admits("--unix-socket-root", posixpath.dirname(path), plan)
    return _finding(error, path, Boundary.LOCAL_SOCKET, hint)


def _finding(error: ErrorLine, path: str, boundary: Boundary, hint: str) -> Finding:
    return Finding(boundary, path, error.errno, error.line, hint)


def _judge_missing(error: ErrorLine, path: str, host: HostPath, plan: PathPlan) -> Finding | None:
    # Missing in the child but present on the host: it was not granted, so it does not exist
    # in the child's constructed view. A file the host lacks is "not found" for a read (the
    # host lacks it too: no boundary); for a write (the wording says so) in a directory the
    # host has but the child's view lacks, the creation failed for want of that directory.
    if plan.visible(path):
        return None
    if host.exists:
        if error.writes:
            return _finding(error, path, Boundary.WRITE, _write_hint(path, host, plan))
        return _read_refusal(error, path, host, plan)
    parent = posixpath.dirname(path)
    if not host.parent_exists or parent == "/" or plan.visible(parent):
        return None  # not found, in the child as on the host
    if error.writes:
        return _finding(error, path, Boundary.WRITE, _write_hint(path, host, plan))
    # Not found on the host either, so no boundary refused a read; but its directory exists
    # only on the host, which refuses a creation there. Said as "not found", with what admits
    # the directory in case the command was creating the file (Python's open(p, "w") says
    # only "No such file or directory").
    hint = (
        f"{path} does not exist on the host either; its directory {parent} is outside the "
        f"roots; if the command was creating it, {_admits('--write-root', parent, plan)}"
    )
    return _finding(error, path, Boundary.UNKNOWN, hint)


def _judge_refused(error: ErrorLine, path: str, host: HostPath, plan: PathPlan) -> Finding | None:
    if not host.exists and not host.parent_exists:
        return None  # the host could neither read nor create it
    writes = (
        error.writes
        or error.errno == "EROFS"
        or not host.exists  # a refused creation
        or (plan.readable(path) and host.readable)  # readable, so refused for writing
    )
    if writes:
        if plan.writable(path):
            return None
        return _finding(error, path, Boundary.WRITE, _write_hint(path, host, plan))
    if plan.readable(path) or not host.readable:
        return None  # granted, or refused by the host's own permissions
    return _read_refusal(error, path, host, plan)


def _read_refusal(error: ErrorLine, path: str, host: HostPath, plan: PathPlan) -> Finding:
    boundary = Boundary.HOME_READ if plan.under_home(path) else Boundary.READ
    where = "" if boundary is Boundary.HOME_READ else f"{path} is outside the read roots; "
    return _finding(error, path, boundary, where + _admits("--read-root", path, plan))


def _write_hint(path: str, host: HostPath, plan: PathPlan) -> str:
    if _under_any(path, plan.read_only_workspaces):
        return "the workspace is read-only (--read-only-workspace): nothing in it is writable"
    if _under_any(path, plan.always_read_only):
        return "kernel interfaces are always read-only inside the sandbox"
    nested = [r for r in plan.read_only if is_under(path, r)]
    if nested:
        return f"it is inside the read-only root {nested[0]}"
    # An existing file or directory is granted as it is; a new one needs its directory.
    target = path if host.exists else posixpath.dirname(path)
    return _admits("--write-root", target, plan)


def _admits(flag: str, target: str, plan: PathPlan) -> str:
    """`FLAG TARGET admits it`, unless TARGET is `/`, a home directory or a parent of one:
    such a grant would open far more than the one path the command asked for."""
    too_wide = target == "/" or any(
        home not in ("", "/") and is_under(home, target) for home in plan.homes
    )
    if too_wide:
        return (
            f"no grant is suggested: granting {target} would open far more than the command "
            "asked for; use a path inside the roots (the workspace, $TMPDIR) instead"
        )
    return f"{flag} {target} admits it"


_HINT_DENY = "credential paths are never readable: the deny list always wins"
_HINT_ABSTRACT = (
    "abstract unix sockets of the host are out of reach (the child has its own network "
    "namespace); nothing admits them"
)


def classify_output(
    text: str, plan: PathPlan, lookup: Callable[[str], HostPath]
) -> RefusalRecord | None:
    """A refusal record from the command's error output, or None when it shows no refusal.

    The last refused path decides the boundary (the fatal error comes last);
    the record names every path refused at that boundary.
    """
    home = plan.homes[0] if plan.homes else "/"
    findings: list[Finding] = []
    seen: dict[str, HostPath] = {}
    for error in error_lines(text[-TAIL_BYTES:]):
        relative = [posixpath.join(plan.cwd, r) for r in error.relative] if plan.cwd else []
        for raw in (*error.paths, *relative):
            path = normalize(raw, home)
            if path not in seen:
                if len(seen) >= MAX_PATHS:
                    continue
                seen[path] = HostPath(False) if path.startswith("@") else lookup(path)
            found = judge(error, path, seen[path], plan)
            if found is not None:
                findings.append(_as_cache(found, plan, lookup))
    if not findings:
        return None
    # A read outside the roots is the weakest evidence: a named boundary after it decides.
    named = [f for f in findings if f.boundary not in (Boundary.READ, Boundary.UNKNOWN)]
    last = (named or findings)[-1]
    same = [f for f in findings if f.boundary is last.boundary]
    return RefusalRecord(
        last.boundary,
        paths=tuple(dict.fromkeys(f.path for f in same)),
        source=SOURCE_OUTPUT,
        hint=last.hint,
        evidence=tuple(dict.fromkeys(f.line for f in same)),
        variable=last.variable,
    )


def _as_cache(found: Finding, plan: PathPlan, lookup: Callable[[str], HostPath]) -> Finding:
    """A refusal on a toolchain's cache is that toolchain's gap, never a credential read.

    Also a refusal on the way to a cache the caller named (`mkdir -p` of GOMODCACHE fails at
    the first directory the view lacks).
    """
    refusable = (Boundary.WRITE, Boundary.HOME_READ, Boundary.UNKNOWN)
    if found.boundary not in refusable or plan.denied(found.path):
        return found
    root = innermost(plan.caches, found.path) or _cache_below(plan.caches, found.path)
    if root is None:
        return found
    exists = lookup(root.path).exists if root.path != found.path else True
    hint = cache_hint(root, found.path, mode=plan.cache_mode, exists=exists)
    return replace(found, boundary=Boundary.TOOLCHAIN_CACHE, hint=hint, variable=root.variable)


_HINT_NAMESPACE = (
    "the seccomp filter refuses new namespaces (unshare, setns, clone with CLONE_NEW*) with "
    "EPERM, so no sandbox or container is built inside run; nothing admits it"
)


def classify_namespace(text: str, plan: PathPlan) -> RefusalRecord | None:
    """A record for a command refused a new namespace by the seccomp filter, else None."""
    if not plan.seccomp:
        return None
    for line in reversed(clean_lines(text[-TAIL_BYTES:])):
        if _patterns().namespace.search(line):
            return RefusalRecord(
                Boundary.SECCOMP, source=SOURCE_OUTPUT, hint=_HINT_NAMESPACE, evidence=(line,)
            )
    return None


# -- connections made without the proxy ------------------------------------------------------

# What clients print when a connection or a name lookup fails (glibc, Python, curl, Go, Node,
# Rust), matched case-insensitively: in the child's network namespace nothing but the proxy
# exists, so a direct dial or a lookup is what fails.
_DIRECT_TEXTS = (
    "network is unreachable",
    "connection refused",
    "couldn't connect to server",
    "no route to host",
    "econnrefused",
    "enetunreach",
)
_LOOKUP_TEXTS = (
    "could not resolve host",
    "temporary failure in name resolution",
    "name or service not known",
    "no address associated with hostname",
    "enotfound",
    "eai_again",
    "dial tcp: lookup",
    "failed to lookup address",
)


@functools.cache
def _words(texts: tuple[str, ...]) -> re.Pattern[str]:
    """The texts as whole words: Node's ENOTFOUND is no part of Python's FileNotFoundError."""
    import re

    return re.compile("|".join(rf"(?<![\w]){re.escape(t)}(?![\w])" for t in texts))


def classify_direct(text: str, proxy: str) -> RefusalRecord | None:
    """A record for a command that dialled or resolved on its own, else None."""
    lines = clean_lines(text[-TAIL_BYTES:])
    dialled = any("connect" in line.lower() for line in lines[-20:])
    for line in reversed(lines):
        lowered = line.lower()
        # Landlock refuses a connect to any other port with EACCES, which names no path.
        bare = lowered.endswith("permission denied") and "/" not in line and "'" not in line
        if bare and dialled:
            lowered = "connection refused"
        if _words(_LOOKUP_TEXTS).search(lowered):
            hint = (
                f"no name resolution inside run: only the proxy at {proxy} is reachable, and it "
                "resolves names itself; use the proxy variables set in the environment"
            )
            return RefusalRecord(Boundary.EGRESS, source=SOURCE_OUTPUT, hint=hint, evidence=(line,))
        if _words(_DIRECT_TEXTS).search(lowered):
            hint = (
                f"direct connection refused: only the proxy at {proxy} is reachable; "
                "use the proxy variables set in the environment (http_proxy, ALL_PROXY...)"
            )
            return RefusalRecord(Boundary.EGRESS, source=SOURCE_OUTPUT, hint=hint, evidence=(line,))
    return None


def _cache_below(roots: Sequence[CacheRoot], path: str) -> CacheRoot | None:
    """A cache location the caller set that lies below `path`."""
    prefix = path.rstrip("/") + "/"
    below = [r for r in roots if r.user_set and r.path.startswith(prefix)]
    return min(below, key=lambda r: len(r.path)) if below else None


# -- requirement and selector (Harn's record fields) ------------------------------------------

# Boundaries whose mechanism every profile requires: the proxy decides every connection, and a
# run without a network boundary refuses to start.
_ALWAYS_REQUIRED = frozenset({Boundary.EGRESS})


def with_requirement(record: RefusalRecord, profile: str) -> RefusalRecord:
    """`requirement` and `selector_honored` for a record of a run under `profile`."""
    if record.boundary in (Boundary.TIMEOUT, Boundary.UNKNOWN):
        requirement = ""
    elif record.boundary in _ALWAYS_REQUIRED or profile == "os_hardened":
        requirement = "profile"
    else:
        requirement = "fallback"
    return replace(record, requirement=requirement, selector_honored=profile == "worktree")


# -- seccomp: a command killed by SIGSYS --------------------------------------------------------

SOURCE_KERNEL = "from the kernel's audit record of the kill"
SOURCE_STATUS = (
    "from the exit status (128+SIGSYS); the kernel log, which names the call, was not readable"
)
SIGSYS = 31
# The kernel's audit record of a seccomp action (AUDIT_SECCOMP).
AUDIT_SECCOMP = "type=1326"
# AUDIT_ARCH_* values as the record prints them, for the names libseccomp knows them by.
AUDIT_ARCHES = {
    "c000003e": "x86_64",
    "40000003": "x86",
    "c00000b7": "aarch64",
    "40000028": "arm",
    "c00000f3": "riscv64",
}
_HINT_SECCOMP = (
    "the seccomp filter kills every system call made through a non-native ABI (i386 "
    "`int 0x80`, x32), since its rules judge native calls only; nothing admits it: build the "
    "program for this machine's own ABI"
)


@dataclass(frozen=True)
class SeccompKill:
    """One kernel audit record of a process killed by seccomp."""

    time: float  # seconds since the epoch, as the record says
    uid: int
    pid: int
    comm: str
    exe: str
    arch: str  # AUDIT_ARCH_* in hex
    syscall: int


def seccomp_kills(lines: Iterable[str], *, since: float, uid: int) -> list[SeccompKill]:
    """Kill records (SIGSYS) of `uid`'s processes from `since` on, from kernel log lines."""
    found = []
    for line in lines:
        if AUDIT_SECCOMP not in line:
            continue
        kill = _parse_kill(line)
        if kill is not None and kill.uid == uid and kill.time >= since:
            found.append(kill)
    return found


def _parse_kill(line: str) -> SeccompKill | None:
    stamp = line.partition("audit(")[2].partition(":")[0]
    fields = _audit_fields(line)
    try:
        if int(fields.get("sig", "0")) != SIGSYS:
            return None
        return SeccompKill(
            float(stamp),
            int(fields["uid"]),
            int(fields["pid"]),
            fields.get("comm", ""),
            fields.get("exe", ""),
            fields.get("arch", ""),
            int(fields["syscall"]),
        )
    except (KeyError, ValueError):
        return None


def _audit_fields(line: str) -> dict[str, str]:
    """key=value pairs of an audit record; quoted values keep their spaces."""
    fields: dict[str, str] = {}
    rest = line
    while "=" in rest:
        key_part, _, rest = rest.partition("=")
        key = key_part.rsplit(" ", 1)[-1]
        if rest.startswith('"'):
            value, _, rest = rest[1:].partition('"')
        else:
            value, _, rest = rest.partition(" ")
        fields[key] = value
    return fields


def seccomp_record(
    kills: Sequence[SeccompKill], name: Callable[[SeccompKill], str]
) -> RefusalRecord:
    """The record of a command killed by SIGSYS; `name` names a kill's system call."""
    if not kills:
        return RefusalRecord(Boundary.SECCOMP, source=SOURCE_STATUS, hint=_HINT_SECCOMP)
    last = kills[-1]
    evidence = tuple(f"{k.comm} ({k.exe}) pid {k.pid}: {name(k)}" for k in kills[-LINE_PATHS:])
    return RefusalRecord(
        Boundary.SECCOMP,
        source=SOURCE_KERNEL,
        hint=_HINT_SECCOMP,
        evidence=evidence,
        system_call=name(last),
    )
