"""Toolchain caches: where each common toolchain keeps its cache, and where a run puts it.

Pure (no I/O). A confined command's home directory is read-only or absent, so every cache a
build writes there fails: Go's build and module caches, Cargo's registry, the npm, pnpm, Yarn,
pip and uv caches, Python's user base, Gradle's and Maven's repositories. A run points each of
them into its scratch space (`.egressbox/cache/` in the workspace, or a private directory with
a read-only workspace) unless the caller set the variable, whose value then stands.

`--toolchain-cache real` (policy: `[filesystem] toolchain_cache = "real"`) grants the tools'
own caches instead, read+write, so a build reuses what the host has downloaded. That shares
them with the command: a hostile one could poison what the host's next build reads. Some
locations are never granted that way because the host *runs* what is in them: `GOPATH` (its
`bin/` is on PATH), Python's user base (`site-packages` is imported, `bin/` on PATH), the XDG
cache home as a whole (it holds other tools' state, pre-commit's hook repositories among them),
Cargo's and Gradle's homes (only their download caches are granted: `~/.cargo/bin` and Gradle's
`init.d` scripts stay read-only).

A refusal on one of these paths is a `toolchain_cache` boundary (confine/refusal.py): the
record names the variable and what would grant the real cache.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import NamedTuple


class CacheMode(StrEnum):
    SCRATCH = "scratch"  # the run's scratch space (default)
    REAL = "real"  # the tools' own caches on the host, read+write


class ToolchainCache(NamedTuple):
    """One cache variable, the tool that reads it, and where its cache is by default."""

    variable: str
    tool: str
    scratch: str  # subdirectory of the scratch cache directory
    # Where the tool writes when the variable is unset ("~/..."), and what real mode grants
    # read+write (empty: never granted, the host runs what is there).
    default: str
    real_grants: tuple[str, ...] = ()
    # Real mode sets the variable to the real location explicitly (the XDG cache home stays in
    # the scratch space, so a default derived from it would not be the real one).
    real_sets: bool = True
    # Default locations a refusal is matched against, when narrower than `default`.
    matches: tuple[str, ...] = ()


# Maven has no cache variable: its local repository is the system property
# maven.repo.local, passed in MAVEN_OPTS (which the `mvn` script hands to the JVM).
MAVEN_OPTS = "MAVEN_OPTS"
MAVEN_REPO = "-Dmaven.repo.local="
# With the module cache in the scratch space, Go's read-only module files would keep
# `rm -rf .egressbox` from working: -modcacherw makes them writable (only when GOFLAGS is unset).
GOFLAGS = "GOFLAGS"
GO_CACHE_RW = "-modcacherw"
# Where the tools' caches live in a run's scratch space: a path holding it is ours (an outer
# run's value, inherited by a nested run), never the caller's choice.
SCRATCH_MARKERS = ("/.egressbox/cache/", "/egressbox-scratch/cache/")

CACHES: tuple[ToolchainCache, ...] = (
    ToolchainCache("XDG_CACHE_HOME", "XDG base directory", "xdg", "~/.cache"),
    ToolchainCache("GOCACHE", "go", "go-build", "{xdg}/go-build", real_grants=("{xdg}/go-build",)),
    ToolchainCache(
        "GOMODCACHE", "go", "go-mod", "{gopath}/pkg/mod", real_grants=("{gopath}/pkg/mod",)
    ),
    ToolchainCache("GOPATH", "go", "go-path", "~/go"),
    ToolchainCache(
        "CARGO_HOME",
        "cargo",
        "cargo",
        "~/.cargo",
        real_grants=("{cargo}/registry", "{cargo}/git"),
        real_sets=False,
    ),
    ToolchainCache("npm_config_cache", "npm", "npm", "~/.npm", real_grants=("~/.npm",)),
    # pnpm's store is $PNPM_HOME/store, else $XDG_DATA_HOME/pnpm/store: PNPM_HOME moves it
    # (npm would warn about an unknown npm_config_store_dir on every call).
    ToolchainCache(
        "PNPM_HOME",
        "pnpm",
        "pnpm",
        "~/.local/share/pnpm",
        real_grants=("{pnpm}/store",),
        real_sets=False,
    ),
    ToolchainCache("YARN_CACHE_FOLDER", "yarn", "yarn", "{xdg}/yarn", real_grants=("{xdg}/yarn",)),
    # Yarn 2+ keeps its shared cache in the global folder (Yarn 1: global packages).
    ToolchainCache("YARN_GLOBAL_FOLDER", "yarn", "yarn-global", "~/.yarn/berry"),
    ToolchainCache("PIP_CACHE_DIR", "pip", "pip", "{xdg}/pip", real_grants=("{xdg}/pip",)),
    ToolchainCache("UV_CACHE_DIR", "uv", "uv", "{xdg}/uv", real_grants=("{xdg}/uv",)),
    ToolchainCache(
        "PYTHONUSERBASE",
        "python",
        "python-user",
        "~/.local",
        matches=("~/.local/lib", "~/.local/bin"),
    ),
    ToolchainCache(
        "GRADLE_USER_HOME",
        "gradle",
        "gradle",
        "~/.gradle",
        real_grants=("{gradle}/caches", "{gradle}/wrapper"),
        real_sets=False,
    ),
    ToolchainCache(
        MAVEN_OPTS, "maven", "m2", "~/.m2/repository", real_grants=("~/.m2/repository",)
    ),
)
# Variables whose user value stands in real mode as in scratch mode, and that real mode
# leaves in the scratch space when the caller did not set them.
NEVER_REAL = frozenset(c.variable for c in CACHES if not c.real_grants)
MISSING = "it does not exist yet"


class CacheRoot(NamedTuple):
    """A cache location outside the run's grants: a refusal under it is a toolchain gap."""

    variable: str
    tool: str
    path: str
    user_set: bool  # the caller's value (else the tool's default location)


class CachePlan(NamedTuple):
    """What a run does with the toolchain caches."""

    env: dict[str, str]  # variables to set in the child's environment
    grants: tuple[tuple[str, str], ...] = ()  # (path, tool): real caches, read+write
    kept: tuple[str, ...] = ()  # cache variables the caller set, left as they are
    # Cache locations a refusal may name (the caller's values and the tools' defaults).
    roots: tuple[CacheRoot, ...] = ()
    notes: tuple[str, ...] = ()  # real caches not granted, and why


def ours(value: str) -> bool:
    """A value an outer run set (its scratch space), not the caller's own."""
    return any(marker in value for marker in SCRATCH_MARKERS)


def user_value(env: Mapping[str, str], cache: ToolchainCache) -> str | None:
    """The caller's value of the cache's variable, or None when unset (or an outer run's)."""
    if cache.variable == MAVEN_OPTS:
        found = _maven_repo(env.get(MAVEN_OPTS, ""))
        return found if found and not ours(found) else None
    value = env.get(cache.variable, "")
    return value if value and not ours(value) else None


def _maven_repo(options: str) -> str | None:
    for word in options.split():
        if word.startswith(MAVEN_REPO):
            return word[len(MAVEN_REPO) :]
    return None


def _any_path(path: str) -> str:
    del path
    return ""


def plan_caches(
    env: Mapping[str, str],
    *,
    home: str,
    scratch: str | None,
    mode: CacheMode,
    check: Callable[[str], str] = _any_path,
) -> CachePlan:
    """The cache variables for the child whose environment is `env` (the caller's, as the
    environment policy passed it, grants applied) and whose scratch cache is `scratch`.

    In real mode `check(path)` says why a real cache may not be granted ("" when it may;
    MISSING when it does not exist yet: that tool's cache then stays in the scratch space,
    and nothing is made in the home directory).
    """
    places = _places(env, home)
    out: dict[str, str] = {}
    grants: list[tuple[str, str]] = []
    kept: list[str] = []
    notes: list[str] = []

    def usable(path: str, tool: str) -> bool:
        why = check(path)
        if why and why != MISSING:
            notes.append(f"{tool}'s cache {path} is not granted: {why}")
        return not why

    for cache in CACHES:
        mine = user_value(env, cache)
        if mine is not None:
            kept.append(cache.variable)
            path = posixpath.normpath(_expand(mine, home))
            if mode is CacheMode.REAL and cache.real_grants and usable(path, cache.tool):
                grants.append((path, cache.tool))
            continue
        if mode is CacheMode.REAL and cache.real_grants:
            real = [posixpath.normpath(_fill(p, places, home)) for p in cache.real_grants]
            real = [p for p in real if usable(p, cache.tool)]
            if real:
                grants += [(p, cache.tool) for p in real]
                if cache.real_sets:
                    out |= _set(cache, real[0], env)
                continue
        if scratch is not None:
            out |= _set(cache, f"{scratch}/{cache.scratch}", env)
    redirected = "GOMODCACHE" in out
    if redirected and not env.get(GOFLAGS):
        out[GOFLAGS] = GO_CACHE_RW
    roots = tuple(_roots(env, places, home))
    return CachePlan(out, tuple(dict.fromkeys(grants)), tuple(kept), roots, tuple(notes))


def _set(cache: ToolchainCache, path: str, env: Mapping[str, str]) -> dict[str, str]:
    if cache.variable != MAVEN_OPTS:
        return {cache.variable: path}
    options = env.get(MAVEN_OPTS, "")
    # An outer run's -Dmaven.repo.local is replaced; the caller's other options stay.
    words = [w for w in options.split() if not w.startswith(MAVEN_REPO)]
    return {MAVEN_OPTS: " ".join([*words, f"{MAVEN_REPO}{path}"])}


def _places(env: Mapping[str, str], home: str) -> dict[str, str]:
    """The caller's own base locations the defaults derive from."""

    def given(name: str, default: str) -> str:
        value = env.get(name, "")
        return _expand(value, home) if value and not ours(value) else _expand(default, home)

    gopath = given("GOPATH", "~/go").split(":")[0]
    return {
        "xdg": given("XDG_CACHE_HOME", "~/.cache"),
        "gopath": gopath,
        "cargo": given("CARGO_HOME", "~/.cargo"),
        "pnpm": given("PNPM_HOME", "~/.local/share/pnpm"),
        "gradle": given("GRADLE_USER_HOME", "~/.gradle"),
    }


def _fill(template: str, places: Mapping[str, str], home: str) -> str:
    return _expand(template.format(**places), home)


def _expand(path: str, home: str) -> str:
    if path == "~" or path.startswith("~/"):
        return home + path[1:]
    return path


def _roots(env: Mapping[str, str], places: Mapping[str, str], home: str) -> list[CacheRoot]:
    """Every cache location a refusal could name: the caller's values, then the tools' default
    locations (a tool that ignores its variable, or a config file that moves it back)."""
    found: list[CacheRoot] = []
    for cache in CACHES:
        mine = user_value(env, cache)
        if mine is not None and posixpath.isabs(_expand(mine, home)):
            path = posixpath.normpath(_expand(mine, home))
            found.append(CacheRoot(cache.variable, cache.tool, path, True))
    for cache in CACHES:
        for template in cache.matches or (cache.default,):
            path = posixpath.normpath(_fill(template, places, home))
            found.append(CacheRoot(cache.variable, cache.tool, path, False))
    return found


def innermost(roots: tuple[CacheRoot, ...], path: str) -> CacheRoot | None:
    """The most specific cache location holding `path` (~/.cache/go-build before ~/.cache)."""
    holding = [r for r in roots if path == r.path or path.startswith(r.path.rstrip("/") + "/")]
    return max(holding, key=lambda r: (len(r.path), r.user_set)) if holding else None


def cache_hint(root: CacheRoot, refused: str, *, mode: CacheMode, exists: bool = True) -> str:
    """What would let the tool write its cache at `root` (`refused` lies in it, or on the way
    to it); a root missing on the host must be made first (a grant binds what exists)."""
    grant_path = root.path
    if not root.user_set and root.variable == "XDG_CACHE_HOME" and refused != root.path:
        # A tool that writes below ~/.cache on its own: grant its directory, not all of them.
        below = refused[len(root.path) :].lstrip("/").split("/")[0]
        grant_path = posixpath.join(root.path, below)
    if root.user_set:
        where = f"{root.variable} points at {root.path}"
    else:
        where = f"{root.path} is {root.tool}'s default location ({root.variable})"
    make = "" if exists else f"mkdir -p {grant_path}, then "
    hint = (
        f"{where}, outside the run's write roots: {make}--process-write-root {grant_path} grants it"
    )
    if root.user_set:
        hint += f", or unset {root.variable} to use the run's scratch space"
    if root.variable not in NEVER_REAL and mode is CacheMode.SCRATCH:
        hint += f"; --toolchain-cache real grants {root.tool}'s real cache"
    return hint
