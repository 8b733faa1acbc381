"""Find what a command needs to start: its executable, interpreter and venv.

Before the filesystem is hidden, `run` resolves CMD on the child's PATH,
follows symlinks and `#!` lines, and grants read+execute to the executable,
its interpreter and, for a Python venv, the venv and its base prefix.
Stdlib only: this runs in the launcher, before asyncio is imported.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from typing import NamedTuple

# `#!` lines longer than this are not followed (Linux itself stops at 256).
MAX_SHEBANG = 256
# Interpreter chains (a script whose interpreter is a script) followed at most.
MAX_CHAIN = 4


class CommandNotFoundError(OSError):
    pass


class Executable(NamedTuple):
    """A command resolved on the child's PATH, and what it needs to run."""

    path: str  # what execve() gets (absolute)
    grants: tuple[str, ...]  # paths to grant read+execute (files and directories)


def resolve_command(argv0: str, env: Mapping[str, str], cwd: str) -> Executable:
    """Resolve argv0 as execvp would on the child's PATH, and what it needs."""
    path = _which(argv0, env, cwd)
    grants: list[str] = []
    current = path
    for _ in range(MAX_CHAIN):
        hops = _link_chain(current)
        grants += hops
        # Python finds its venv from the path it was started by, not the
        # symlink's target (`.venv/bin/python -> /usr/bin/python3.11`): look
        # for pyvenv.cfg beside every hop, the final target included.
        for hop in dict.fromkeys(hops):
            grants += _python_prefixes(hop)
        interpreter = _shebang(os.path.realpath(current))
        if interpreter is None:
            break
        current = interpreter if os.path.isabs(interpreter) else _which(interpreter, env, cwd)
    return Executable(path, tuple(dict.fromkeys(grants)))


def _which(name: str, env: Mapping[str, str], cwd: str) -> str:
    if "/" in name:
        path = name if os.path.isabs(name) else os.path.join(cwd, name)
        if os.path.isfile(path):
            return os.path.normpath(path)
        raise CommandNotFoundError(2, f"{name}: no such file")
    found = _search_path(name, env.get("PATH", os.defpath), cwd)
    if found is None:
        raise CommandNotFoundError(2, f"{name}: command not found on PATH")
    return found


def _search_path(name: str, path: str, cwd: str) -> str | None:
    # As execvp: the first executable regular file on PATH (an empty entry is
    # the current directory). Not shutil.which: importing shutil costs ~5 ms
    # (bz2, lzma) on every `egressbox run`.
    for entry in path.split(os.pathsep):
        candidate = os.path.join(os.path.join(cwd, entry) if entry else cwd, name)
        try:
            mode = os.stat(candidate).st_mode
        except OSError:
            continue
        if stat.S_ISREG(mode) and os.access(candidate, os.X_OK):
            return os.path.abspath(candidate)
    return None


def _link_chain(path: str) -> list[str]:
    """The path, every symlink hop and the final target."""
    hops = [path]
    current = path
    for _ in range(40):  # ELOOP bound, as the kernel's
        if not os.path.islink(current):
            break
        target = os.readlink(current)
        current = os.path.normpath(os.path.join(os.path.dirname(current), target))
        hops.append(current)
    hops.append(os.path.realpath(path))
    return hops


def _shebang(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            head = f.read(MAX_SHEBANG)
    except OSError:
        return None
    if not head.startswith(b"#!"):
        return None
    line = head[2:].split(b"\n", 1)[0].strip()
    if not line:
        return None
    interpreter = line.split()[0].decode(errors="replace")
    if os.path.basename(interpreter) == "env" and len(line.split()) > 1:
        # `#!/usr/bin/env python3`: the interpreter is the first non-option word.
        words = [w.decode(errors="replace") for w in line.split()[1:]]
        names = [w for w in words if not w.startswith("-")]
        return names[0] if names else interpreter
    return interpreter


def _python_prefixes(real: str) -> list[str]:
    """A venv's directory and its base interpreter prefix (from pyvenv.cfg)."""
    grants: list[str] = []
    bindir = os.path.dirname(real)
    for candidate in (os.path.dirname(bindir), bindir):
        cfg = os.path.join(candidate, "pyvenv.cfg")
        if os.path.isfile(cfg):
            grants.append(candidate)
            home = _cfg_home(cfg)
            if home:
                grants.append(os.path.dirname(home) if home.endswith("/bin") else home)
            break
    # An interpreter outside a venv needs its own prefix (stdlib, site-packages).
    name = os.path.basename(real)
    if name.startswith("python") and not grants and bindir.endswith("/bin"):
        grants.append(os.path.dirname(bindir))
    return grants


def _cfg_home(cfg: str) -> str | None:
    try:
        with open(cfg, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition("=")
                if sep and key.strip() == "home":
                    return os.path.realpath(value.strip())
    except OSError:
        return None
    return None
