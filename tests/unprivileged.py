"""Run the tests' children as the invoking user or as an unprivileged test user.

The project's own interpreter may be out of an unprivileged user's reach (a
pyenv build under /root is mode 0700: DESIGN §7, "Testing as an unprivileged
user"), and an editable install points into the checkout, so for that user a
venv is built from Debian's /usr/bin/python3.11 in a
world-readable directory outside /tmp, and the project is installed into it
(not editable) from a copy of the source tree. The venv is named after a
hash of that tree, so a rerun with unchanged sources reuses it; a lock file
keeps concurrent sessions from building the same one twice.

An Actor says how to run a command as one user: which interpreter and which
`egressbox` to use, and how to wrap argv (`runuser -u USER -- env -i ...`
for the test user). Directories a test hands to an actor are made with
`actor.make_dir`, so the actor owns them.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

TEST_USER = "egressbox-test"
# World-readable, outside /tmp (a confined child sees a private /tmp).
BASE_DIR = Path("/var/lib/egressbox-test")
BASE_PYTHON = Path("/usr/bin/python3.11")
RUNUSER = "/usr/sbin/runuser"
# A clean PATH for children: no pyenv shims (unreadable for another user).
CLEAN_PATH = "/usr/local/bin:/usr/bin:/bin"
# Bounds on the one-off set-up steps.
USERADD_TIMEOUT = 60
VENV_TIMEOUT = 600
PROBE_TIMEOUT = 60
LOCK_WAIT = 900.0
# Venvs of older source trees (another checkout, an edit since) beyond the newest few are
# removed once unused for this long (another session may still be using one).
KEEP_VENVS = 2
STALE_AFTER_S = 3600
# What the installed copy of the project is built from.
SOURCE_FILES = ("pyproject.toml", "README.md")
SOURCE_DIRS = ("src",)
_IGNORED_PARTS = ("__pycache__", ".egg-info", ".mypy_cache", ".ruff_cache")


class UnavailableError(Exception):
    """The unprivileged set-up is impossible here; the message is the skip reason."""


def repo_root() -> Path:
    """The project checkout this file belongs to (tests/ -> the root)."""
    return Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Actor:
    """Who runs a test's children, and with which interpreter and `egressbox`."""

    name: str
    uid: int
    gid: int
    python: str
    # argv prefix that starts `egressbox` (e.g. [python, "-m", "egressbox"])
    egressbox: tuple[str, ...]
    runuser: bool = False

    @property
    def user(self) -> str:
        return pwd.getpwuid(self.uid).pw_name

    def command(
        self, argv: Sequence[str], env: Mapping[str, str]
    ) -> tuple[list[str], dict[str, str]]:
        """argv and the environment for subprocess: as this actor, with exactly `env`."""
        if not self.runuser:
            return list(argv), dict(env)
        pairs = [f"{name}={value}" for name, value in env.items()]
        wrapped = [RUNUSER, "-u", self.user, "--", "/usr/bin/env", "-i", *pairs, *argv]
        return wrapped, {"PATH": CLEAN_PATH}

    def make_dir(self, parent: str | Path, prefix: str, mode: int = 0o755) -> Path:
        """A fresh directory under `parent` that this actor owns."""
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        self.own(path, mode)
        return path

    def own(self, path: str | Path, mode: int | None = None) -> None:
        if mode is not None:
            os.chmod(path, mode)
        if self.uid != os.geteuid():
            os.chown(path, self.uid, self.gid)

    def base_env(self, home: str | Path) -> dict[str, str]:
        """A minimal, predictable environment (no proxy or egressbox variables).

        The test user's egressbox state lives in a directory of its own outside every test's
        workspace (by default it would be under HOME, which tests often grant writable, and
        `run` refuses a writable root holding it)."""
        env = {"PATH": CLEAN_PATH, "HOME": str(home), "LANG": "C.UTF-8", "USER": self.user}
        if self.runuser:
            env["EGRESSBOX_STATE_DIR"] = str(self.state_dir())
        return env

    def state_dir(self) -> Path:
        """BASE_DIR/state-UID, the actor's own (0700)."""
        path = BASE_DIR / f"state-{self.uid}"
        with contextlib.suppress(FileExistsError):
            path.mkdir(mode=0o700)
            self.own(path, 0o700)
        return path


def invoking_actor() -> Actor:
    """The user running pytest, with the project's own interpreter."""
    name = "root" if os.geteuid() == 0 else "invoker"
    python = sys.executable
    return Actor(name, os.geteuid(), os.getegid(), python, (python, "-m", "egressbox"))


# -- the unprivileged user --------------------------------------------------------------


def unprivileged_actor(source: Path | None = None) -> Actor:
    """The test user with a venv holding this source tree; UnavailableError says why not."""
    if os.geteuid() != 0:
        raise UnavailableError("creating the test user and switching to it needs root")
    for tool in (RUNUSER, str(BASE_PYTHON)):
        if not os.access(tool, os.X_OK):
            raise UnavailableError(f"{tool} is not available")
    uid, gid = ensure_user(TEST_USER)
    venv = ensure_venv(source or repo_root())
    python = str(venv / "bin" / "python")
    actor = Actor("unprivileged", uid, gid, python, (python, "-m", "egressbox"), runuser=True)
    reason = namespace_problem(actor)
    if reason is not None:
        raise UnavailableError(reason)
    return actor


def ensure_user(name: str) -> tuple[int, int]:
    with contextlib.suppress(KeyError):
        entry = pwd.getpwnam(name)
        return entry.pw_uid, entry.pw_gid
    command = [
        "useradd",
        "--system",
        "--no-create-home",
        "--home-dir",
        "/nonexistent",
        "--shell",
        "/usr/sbin/nologin",
        name,
    ]
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=USERADD_TIMEOUT
    )
    # Another session may have created it in the meantime (useradd exits 9).
    with contextlib.suppress(KeyError):
        entry = pwd.getpwnam(name)
        return entry.pw_uid, entry.pw_gid
    raise UnavailableError(f"useradd {name} failed: {done.stderr.strip() or done.returncode}")


def source_digest(root: Path) -> str:
    """A hash of every file the installed copy is built from (names and contents)."""
    digest = hashlib.sha256()
    for path in sorted(_source_files(root)):
        digest.update(str(path.relative_to(root)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def _source_files(root: Path) -> Iterator[Path]:
    for name in SOURCE_FILES:
        if (root / name).is_file():
            yield root / name
    for name in SOURCE_DIRS:
        for path in (root / name).rglob("*"):
            if path.is_file() and not _ignored(path):
                yield path


def _ignored(path: Path) -> bool:
    return path.suffix == ".pyc" or any(
        part.endswith(_IGNORED_PARTS) or part in _IGNORED_PARTS for part in path.parts
    )


def ensure_venv(root: Path) -> Path:
    """BASE_DIR/venv-<digest> with the project installed; built once per source tree.

    Built at its final path (a venv's scripts name the path they were made at); the
    `.complete` marker, written last, tells a finished venv from an interrupted build.
    """
    _make_public_dir(BASE_DIR)
    venv = BASE_DIR / f"venv-{source_digest(root)}"
    marker = venv / ".complete"
    with _locked(BASE_DIR / ".lock"):
        if marker.exists():
            marker.touch()
            return venv
        _prune_stale(keep=venv)
        shutil.rmtree(venv, ignore_errors=True)
        try:
            _build_venv(venv, root)
        except BaseException:
            shutil.rmtree(venv, ignore_errors=True)
            raise
        marker.touch()
    return venv


def _build_venv(venv: Path, root: Path) -> None:
    _run([str(BASE_PYTHON), "-m", "venv", str(venv)], "create the venv")
    # From a copy: building in the checkout would leave build/ and *.egg-info in it.
    with tempfile.TemporaryDirectory(prefix="egressbox-src-") as copy:
        for name in SOURCE_FILES:
            if (root / name).is_file():
                shutil.copy2(root / name, Path(copy) / name)
        for name in SOURCE_DIRS:
            shutil.copytree(
                root / name,
                Path(copy) / name,
                ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"),
            )
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", copy]
        _run(pip, "install the project into the venv")
    _make_tree_readable(venv)


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(
        command, check=False, capture_output=True, text=True, timeout=VENV_TIMEOUT
    )
    if done.returncode != 0:
        raise UnavailableError(f"cannot {what}: {done.stderr.strip()[-800:]}")


def _prune_stale(keep: Path) -> None:
    """Remove venvs of older source trees: all but the newest few, once unused for a while."""

    def last_used(path: Path) -> float:
        for candidate in (path / ".complete", path):
            with contextlib.suppress(OSError):
                return candidate.stat().st_mtime
        return 0.0

    others = sorted((p for p in BASE_DIR.glob("venv-*") if p != keep), key=last_used, reverse=True)
    now = time.time()
    for path in others[KEEP_VENVS:]:
        if now - last_used(path) > STALE_AFTER_S:
            shutil.rmtree(path, ignore_errors=True)


def _make_public_dir(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    os.chmod(path, 0o755)


def _make_tree_readable(root: Path) -> None:
    for directory, _dirs, files in os.walk(root):
        os.chmod(directory, os.stat(directory).st_mode | 0o755)
        for name in files:
            path = os.path.join(directory, name)
            if not os.path.islink(path):
                os.chmod(path, os.stat(path).st_mode | 0o444)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise UnavailableError(f"{path} stayed locked") from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)


def namespace_problem(actor: Actor) -> str | None:
    """Why `egressbox run` cannot build its namespaces as `actor` (None when it can)."""
    argv, env = actor.command(
        [*actor.egressbox, "doctor", "--json"], actor.base_env("/nonexistent")
    )
    done = subprocess.run(
        argv, check=False, capture_output=True, text=True, timeout=PROBE_TIMEOUT, env=env, cwd="/"
    )
    try:
        mechanisms = json.loads(done.stdout)["mechanisms"]
    except (ValueError, KeyError):
        return f"`egressbox doctor` failed as {actor.user}: {done.stderr.strip()[-400:]}"
    for name in ("user_namespace", "network_namespace"):
        entry = mechanisms.get(name, {})
        if entry.get("status") != "available":
            return f"{name} as {actor.user}: {entry.get('status')} ({entry.get('detail')})"
    return None
